// SPDX-License-Identifier: Apache-2.0

package desired

import (
	"net/netip"
	"reflect"
	"testing"
	"time"
)

// Keys print as address:port/protocol, an IPv6 address in brackets (as
// netip.AddrPort prints it), so the port is never read as part of it.
func TestKeyString(t *testing.T) {
	for _, c := range []struct {
		key  Key
		want string
	}{
		{Key{VIP: netip.MustParseAddr("198.18.100.1"), Port: 80, Protocol: TCP}, "198.18.100.1:80/tcp"},
		{Key{VIP: netip.MustParseAddr("2001:2::10"), Port: 80, Protocol: TCP}, "[2001:2::10]:80/tcp"},
		{Key{VIP: netip.MustParseAddr("fd00::53"), Port: 53, Protocol: UDP}, "[fd00::53]:53/udp"},
	} {
		if got := c.key.String(); got != c.want {
			t.Errorf("%#v.String() = %q, want %q", c.key, got, c.want)
		}
	}
}

// Equal compares every field: a field added to Service or State without
// Equal knowing of it would leave a changed service unprogrammed.
func TestEqualEveryField(t *testing.T) {
	base := func() State {
		return State{
			Services: []Service{{
				Name: "web", Key: Key{VIP: netip.MustParseAddr("198.18.100.1"), Port: 80, Protocol: TCP},
				Endpoints: []Endpoint{{Addr: netip.MustParseAddrPort("198.18.1.2:8080"), Name: "ns/a"}},
			}},
			HandBack: []Key{{VIP: netip.MustParseAddr("198.18.100.2"), Port: 80, Protocol: TCP}},
			Node:     &Node{Interfaces: []string{"eth0"}, TableSize: 1021},
		}
	}
	a, b := base(), base()
	if !a.Equal(&b) {
		t.Fatal("equal states differ")
	}
	// One mutation per field of Service (and the State's own), each of
	// which must make the states differ.
	muts := map[string]func(s *State){
		"Name":                   func(s *State) { s.Services[0].Name = "api" },
		"Key":                    func(s *State) { s.Services[0].Key.Port = 81 },
		"Endpoints":              func(s *State) { s.Services[0].Endpoints[0].Name = "ns/b" },
		"Accrual":                func(s *State) { s.Services[0].Accrual.MaxFailures = 9 },
		"MaxInflight":            func(s *State) { s.Services[0].MaxInflight = 1 },
		"MaxInflightPerEndpoint": func(s *State) { s.Services[0].MaxInflightPerEndpoint = 1 },
		"RetryRefused":           func(s *State) { s.Services[0].RetryRefused = true },
		"Affinity":               func(s *State) { s.Services[0].Affinity = time.Second },
		"Served":                 func(s *State) { s.Services[0].Served = "scope-all" },
		"Services":               func(s *State) { s.Services = append(s.Services, s.Services[0]) },
		"HandBack":               func(s *State) { s.HandBack = nil },
		"Node":                   func(s *State) { s.Node.TableSize = 2039 },
		"Delta":                  func(s *State) { s.Delta = true },
		"Gone":                   func(s *State) { s.Gone = s.HandBack },
	}
	for name, mut := range muts {
		b := base()
		mut(&b)
		if a.Equal(&b) || b.Equal(&a) {
			t.Errorf("a change of %s is not seen", name)
		}
	}
	if n := reflect.TypeFor[Service]().NumField() + reflect.TypeFor[State]().NumField(); n != len(muts) {
		t.Errorf("Service and State have %d fields, the test mutates %d: teach Equal (and this test) the new ones", n, len(muts))
	}
}

// Merge stands a delta for the complete state: services it lists replace
// those of their key, those gone go, the rest stay, in name order.
func TestMerge(t *testing.T) {
	key := func(last byte) Key {
		return Key{VIP: netip.AddrFrom4([4]byte{198, 18, 100, last}), Port: 80, Protocol: TCP}
	}
	svc := func(name string, k Key, eps int) Service {
		s := Service{Name: name, Key: k}
		for i := range eps {
			s.Endpoints = append(s.Endpoints, Endpoint{Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, 0, byte(i)}), 80)})
		}
		return s
	}
	full := State{Services: []Service{svc("a", key(1), 1), svc("b", key(2), 1), svc("c", key(3), 1)}}
	d := State{Delta: true, Services: []Service{svc("b", key(2), 2), svc("bb", key(4), 1)}, Gone: []Key{key(3)},
		HandBack: []Key{key(3)}}
	got := full.Merge(d)
	want := State{Services: []Service{svc("a", key(1), 1), svc("b", key(2), 2), svc("bb", key(4), 1)}, HandBack: []Key{key(3)}}
	if !got.Equal(&want) {
		t.Errorf("Merge = %+v, want %+v", got, want)
	}
	// A complete state is its own merge.
	if got := full.Merge(want); !got.Equal(&want) {
		t.Errorf("Merge of a complete state = %+v, want it", got)
	}
}
