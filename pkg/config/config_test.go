// SPDX-License-Identifier: Apache-2.0

package config

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/desired"
)

func TestExample(t *testing.T) {
	c, err := Load("testdata/example.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"cl0", "b1", "b2", "b3"}; !reflect.DeepEqual(c.Interfaces, want) {
		t.Errorf("Interfaces = %v, want %v", c.Interfaces, want)
	}
	if want := []string{"b1"}; !reflect.DeepEqual(c.RedirectInterfaces, want) {
		t.Errorf("RedirectInterfaces = %v, want %v", c.RedirectInterfaces, want)
	}
	if c.MaglevTableSize != 16381 {
		t.Errorf("MaglevTableSize = %d, want 16381", c.MaglevTableSize)
	}
	defaults := accrual.Settings{
		Mode:               accrual.ModeConsecutive,
		MaxFailures:        5,
		MinPenalty:         10 * time.Second,
		MaxPenalty:         5 * time.Minute,
		JitterRatio:        0.2,
		ConnectTimeout:     time.Second,
		FailureKinds:       accrual.KindsOf(accrual.KindRefused, accrual.KindTimeout, accrual.KindReset),
		MaxEjectionPercent: 50,
	}
	// The window rules' settings are the library's defaults here.
	lib := accrual.Defaults()
	defaults.Window, defaults.MinCalls, defaults.FailureRateThreshold = lib.Window, lib.MinCalls, lib.FailureRateThreshold
	defaults.SlowConnectRateThreshold = lib.SlowConnectRateThreshold
	defaults.OutlierStdevFactor, defaults.OutlierMinHosts, defaults.OutlierMinCalls = lib.OutlierStdevFactor, lib.OutlierMinHosts, lib.OutlierMinCalls
	defaults.FleetEvidence = lib.FleetEvidence // no fleet in standalone mode; the field stays the default
	if c.Defaults != defaults {
		t.Errorf("Defaults = %+v, want %+v", c.Defaults, defaults)
	}
	dns := defaults
	dns.Mode = accrual.ModeNone
	api := defaults
	api.MaxFailures = 3
	api.JitterRatio = 0
	api.FailureKinds = accrual.KindsOf(accrual.KindRefused, accrual.KindTimeout, accrual.KindReset, accrual.KindResetAfterData)

	vip1 := netip.MustParseAddr("198.18.100.1")
	eps := func(addrs ...string) []desired.Endpoint {
		out := []desired.Endpoint{}
		for _, a := range addrs {
			out = append(out, desired.Endpoint{Addr: netip.MustParseAddrPort(a)})
		}
		return out
	}
	want := desired.State{Services: []desired.Service{
		{
			Name:      "web",
			Key:       desired.Key{VIP: vip1, Port: 80, Protocol: desired.TCP},
			Endpoints: eps("198.18.1.2:8080", "198.18.2.2:8080", "198.18.3.2:8080"),
			Accrual:   defaults,
		},
		{
			Name:      "dns",
			Key:       desired.Key{VIP: vip1, Port: 53, Protocol: desired.UDP},
			Endpoints: eps("198.18.1.2:53", "198.18.2.2:53"),
			Accrual:   dns,
		},
		{
			Name:      "api/v2",
			Key:       desired.Key{VIP: netip.MustParseAddr("198.18.100.2"), Port: 443, Protocol: desired.TCP},
			Endpoints: eps("198.18.3.2:8443"),
			Accrual:   api,
		},
		{
			Name:      "drained",
			Key:       desired.Key{VIP: netip.MustParseAddr("198.18.100.3"), Port: 8080, Protocol: desired.TCP},
			Endpoints: eps(),
			Accrual:   defaults,
		},
	}}
	for i := range want.Services {
		want.Services[i].RetryRefused = true // the default
	}
	got := c.Desired()
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Desired() =\n%+v\nwant\n%+v", got, want)
	}
	for _, s := range got.Services {
		if err := s.Accrual.Validate(); err != nil {
			t.Errorf("%s: accrual invalid: %v", s.Name, err)
		}
	}

	// The result is a copy: changing it leaves the Config alone.
	got.Services[0].Endpoints[0].Addr = netip.AddrPort{}
	if c.Desired().Services[0].Endpoints[0].Addr != netip.MustParseAddrPort("198.18.1.2:8080") {
		t.Error("Desired() shares endpoint memory with Config")
	}
}

func TestMinimal(t *testing.T) {
	c, err := Parse([]byte("interfaces: [eth0]\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.MaglevTableSize != DefaultMaglevTableSize || c.Defaults != accrual.Defaults() ||
		len(c.Services) != 0 || c.RedirectInterfaces != nil {
		t.Errorf("got %+v", c)
	}
	if st := c.Desired(); st.Services == nil || len(st.Services) != 0 {
		t.Errorf("Desired() = %#v, want no services", st)
	}
	for _, doc := range []string{
		"interfaces: [eth0]\nservices: []\n",
		"%YAML 1.1\n---\n# c\ninterfaces: [eth0]\n...\n\n# trailing comment\n",
		"--- # comment\ninterfaces: [eth0]\r\n---\n",
		"--- {interfaces: [eth0]}\n",
		"interfaces: [eth0]\nservices:\nmaglev:\ndefaults: {failureAccrual: {}}\n"} {
		if _, err := Parse([]byte(doc)); err != nil {
			t.Errorf("%q: %v", doc, err)
		}
	}
}

// TestMerge checks that accrual settings merge field by field: built-in,
// then defaults.failureAccrual, then the service's failureAccrual.
func TestMerge(t *testing.T) {
	builtin := accrual.Defaults()
	with := func(f func(*accrual.Settings)) accrual.Settings {
		s := builtin
		f(&s)
		return s
	}
	tests := []struct {
		name, defaults, service   string // failureAccrual blocks, "" to omit
		wantDefaults, wantService accrual.Settings
	}{
		{
			name:         "built-in only",
			wantDefaults: builtin, wantService: builtin,
		},
		{
			name:         "defaults block only",
			defaults:     "{maxFailures: 5, minPenalty: 2s}",
			wantDefaults: with(func(s *accrual.Settings) { s.MaxFailures = 5; s.MinPenalty = 2 * time.Second }),
			wantService:  with(func(s *accrual.Settings) { s.MaxFailures = 5; s.MinPenalty = 2 * time.Second }),
		},
		{
			name:         "service block only",
			service:      "{connectTimeout: 250ms}",
			wantDefaults: builtin,
			wantService:  with(func(s *accrual.Settings) { s.ConnectTimeout = 250 * time.Millisecond }),
		},
		{
			name:     "service overrides one field and keeps the others from defaults",
			defaults: "{maxFailures: 5, minPenalty: 2s, maxPenalty: 10m}",
			service:  "{maxFailures: 9, maxEjectionPercent: 30}",
			wantDefaults: with(func(s *accrual.Settings) {
				s.MaxFailures = 5
				s.MinPenalty = 2 * time.Second
				s.MaxPenalty = 10 * time.Minute
			}),
			wantService: with(func(s *accrual.Settings) {
				s.MaxFailures = 9
				s.MinPenalty = 2 * time.Second
				s.MaxPenalty = 10 * time.Minute
				s.MaxEjectionPercent = 30
			}),
		},
		{
			name:         "explicit zero overrides",
			defaults:     "{jitterRatio: 0.1}",
			service:      "{jitterRatio: 0, maxEjectionPercent: 0}",
			wantDefaults: with(func(s *accrual.Settings) { s.JitterRatio = 0.1 }),
			wantService:  with(func(s *accrual.Settings) { s.JitterRatio = 0; s.MaxEjectionPercent = 0 }),
		},
		{
			name:     "failureKinds list replaces, not adds",
			defaults: "{failureKinds: [refused, reset-after-data]}",
			service:  "{failureKinds: [timeout]}",
			wantDefaults: with(func(s *accrual.Settings) {
				s.FailureKinds = accrual.KindsOf(accrual.KindRefused, accrual.KindResetAfterData)
			}),
			wantService: with(func(s *accrual.Settings) { s.FailureKinds = accrual.KindsOf(accrual.KindTimeout) }),
		},
		{
			name:         "mode none with no kinds",
			service:      "{mode: none, failureKinds: []}",
			wantDefaults: builtin,
			wantService:  with(func(s *accrual.Settings) { s.Mode = accrual.ModeNone; s.FailureKinds = 0 }),
		},
		{
			name:         "service min and max checked together",
			defaults:     "{maxPenalty: 1m}",
			service:      "{minPenalty: 2m, maxPenalty: 3m}",
			wantDefaults: builtin,
			wantService:  with(func(s *accrual.Settings) { s.MinPenalty = 2 * time.Minute; s.MaxPenalty = 3 * time.Minute }),
		},
		{
			name:         "null block is absent",
			defaults:     "null",
			service:      "~",
			wantDefaults: builtin, wantService: builtin,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			doc := "interfaces: [eth0]\n"
			if tt.defaults != "" {
				doc += "defaults:\n  failureAccrual: " + tt.defaults + "\n"
			}
			doc += "services:\n- name: a\n  vip: 198.18.0.1\n  port: 80\n"
			if tt.service != "" {
				doc += "  failureAccrual: " + tt.service + "\n"
			}
			c, err := Parse([]byte(doc))
			if err != nil {
				t.Fatalf("Parse:\n%s\n%v", doc, err)
			}
			if c.Defaults != tt.wantDefaults {
				t.Errorf("Defaults = %+v, want %+v", c.Defaults, tt.wantDefaults)
			}
			if got := c.Services[0].Accrual; got != tt.wantService {
				t.Errorf("service accrual = %+v, want %+v", got, tt.wantService)
			}
			if got := c.Desired().Services[0].Accrual; got != tt.wantService {
				t.Errorf("Desired accrual = %+v, want %+v", got, tt.wantService)
			}
		})
	}
}

// v6svc is a config with one service of the given vip and backends (YAML
// flow scalars, quoted: IPv6 addresses hold colons).
func v6svc(vip, backends string) string {
	return "interfaces: [eth0]\nservices:\n- {name: web, vip: " + vip + ", port: 80, backends: [" + backends + "]}\n"
}

// svc is a valid config with one service whose YAML flow-mapping body is
// extra appended to a valid service body.
func svc(extra string) string {
	return "interfaces: [eth0]\nservices:\n- {name: web, vip: 198.18.0.1, port: 80" + extra + "}\n"
}

func TestErrors(t *testing.T) {
	tests := []struct {
		name string
		doc  string
		// The error must contain a FieldError with this path and value,
		// and its text "path: value: " followed by msg somewhere after.
		path, value, msg string
	}{
		// interfaces
		{"missing interfaces", "services: []", "interfaces", "", "required"},
		{"null interfaces", "interfaces: null", "interfaces", "", "required"},
		{"empty interfaces", "interfaces: []", "interfaces", "[]", "must not be empty"},
		{"duplicate interface", "interfaces: [a, b, a]", "interfaces[2]", `"a"`, "duplicate of interfaces[0]"},
		{"interface name too long", "interfaces: [abcdefghijklmnop]", "interfaces[0]", `"abcdefghijklmnop"`, "1 to 15 bytes"},
		{"empty interface name", "interfaces: ['']", "interfaces[0]", `""`, "1 to 15 bytes"},
		{"interface name with slash", "interfaces: [a, 'b/c']", "interfaces[1]", `"b/c"`, "'/'"},
		{"interface name with space", "interfaces: ['b c']", "interfaces[0]", `"b c"`, "whitespace"},
		{"interface name with colon", "interfaces: ['eth0:1']", "interfaces[0]", `"eth0:1"`, "':'"},
		{"interface name dot", "interfaces: ['..']", "interfaces[0]", `".."`, `"." or ".."`},
		{"interface name number", "interfaces: [eth0, 1]", "interfaces[1]", "1", "want a string"},
		{"interfaces not a list", "interfaces: eth0", "interfaces", `"eth0"`, "want a list"},
		{"redirect not listed", "interfaces: [a]\nredirectInterfaces: [a, b]", "redirectInterfaces[1]", `"b"`, "not listed in interfaces"},
		{"redirect duplicate", "interfaces: [a]\nredirectInterfaces: [a, a]", "redirectInterfaces[1]", `"a"`, "duplicate of redirectInterfaces[0]"},

		// maglev
		{"table size not prime", "interfaces: [a]\nmaglev: {tableSize: 16384}", "maglev.tableSize", "16384", "must be prime"},
		{"table size too small", "interfaces: [a]\nmaglev: {tableSize: 5}", "maglev.tableSize", "5", "must be within [7, 1048573]"},
		{"table size too big", "interfaces: [a]\nmaglev: {tableSize: 1048583}", "maglev.tableSize", "1048583", "must be within [7, 1048573]"},
		{"table size negative", "interfaces: [a]\nmaglev: {tableSize: -7}", "maglev.tableSize", "-7", "must be within"},
		{"table size string", "interfaces: [a]\nmaglev: {tableSize: '16381'}", "maglev.tableSize", `"16381"`, "want an integer"},
		{"table size float", "interfaces: [a]\nmaglev: {tableSize: 7.5}", "maglev.tableSize", "7.5", "want an integer"},
		{"maglev not a mapping", "interfaces: [a]\nmaglev: 16381", "maglev", "16381", "want a mapping"},

		// defaults.failureAccrual, field by field
		{"unknown mode", "interfaces: [a]\ndefaults: {failureAccrual: {mode: sometimes}}",
			"defaults.failureAccrual.mode", `"sometimes"`, "unknown mode (want consecutive, failure-rate, unified or none)"},
		{"uppercase mode", "interfaces: [a]\ndefaults: {failureAccrual: {mode: Consecutive}}",
			"defaults.failureAccrual.mode", `"Consecutive"`, "unknown mode"},
		{"zero maxFailures", "interfaces: [a]\ndefaults: {failureAccrual: {maxFailures: 0}}",
			"defaults.failureAccrual.maxFailures", "0", "must be at least 1"},
		{"negative maxFailures", "interfaces: [a]\ndefaults: {failureAccrual: {maxFailures: -3}}",
			"defaults.failureAccrual.maxFailures", "-3", "must be at least 1"},
		{"maxFailures as string", "interfaces: [a]\ndefaults: {failureAccrual: {maxFailures: '5'}}",
			"defaults.failureAccrual.maxFailures", `"5"`, "want an integer"},
		{"maxFailures as bool", "interfaces: [a]\ndefaults: {failureAccrual: {maxFailures: true}}",
			"defaults.failureAccrual.maxFailures", "true", "want an integer"},
		{"bad duration", "interfaces: [a]\ndefaults: {failureAccrual: {minPenalty: 5 min}}",
			"defaults.failureAccrual.minPenalty", `"5 min"`, "invalid duration"},
		{"duration without unit", "interfaces: [a]\ndefaults: {failureAccrual: {maxPenalty: '30'}}",
			"defaults.failureAccrual.maxPenalty", `"30"`, "invalid duration"},
		{"duration as number", "interfaces: [a]\ndefaults: {failureAccrual: {connectTimeout: 10}}",
			"defaults.failureAccrual.connectTimeout", "10", "want a duration"},
		{"negative duration", "interfaces: [a]\ndefaults: {failureAccrual: {minPenalty: -1s}}",
			"defaults.failureAccrual.minPenalty", `"-1s"`, "must be positive"},
		{"zero connect timeout", "interfaces: [a]\ndefaults: {failureAccrual: {connectTimeout: 0s}}",
			"defaults.failureAccrual.connectTimeout", `"0s"`, "must be positive"},
		{"min over max in defaults", "interfaces: [a]\ndefaults: {failureAccrual: {minPenalty: 2m, maxPenalty: 1m}}",
			"defaults.failureAccrual.minPenalty", `"2m"`, "must not exceed maxPenalty (1m0s)"},
		{"jitter above 1", "interfaces: [a]\ndefaults: {failureAccrual: {jitterRatio: 1.5}}",
			"defaults.failureAccrual.jitterRatio", "1.5", "must be within [0, 1]"},
		{"negative jitter", "interfaces: [a]\ndefaults: {failureAccrual: {jitterRatio: -0.1}}",
			"defaults.failureAccrual.jitterRatio", "-0.1", "must be within [0, 1]"},
		{"jitter as string", "interfaces: [a]\ndefaults: {failureAccrual: {jitterRatio: '0.2'}}",
			"defaults.failureAccrual.jitterRatio", `"0.2"`, "want a number"},
		{"unknown kind", "interfaces: [a]\ndefaults: {failureAccrual: {failureKinds: [refused, bogus]}}",
			"defaults.failureAccrual.failureKinds[1]", `"bogus"`, "unknown failure kind"},
		{"duplicate kind", "interfaces: [a]\ndefaults: {failureAccrual: {failureKinds: [reset, timeout, reset]}}",
			"defaults.failureAccrual.failureKinds[2]", `"reset"`, "duplicate of failureKinds[0]"},
		{"empty kinds in consecutive mode", "interfaces: [a]\ndefaults: {failureAccrual: {failureKinds: []}}",
			"defaults.failureAccrual.failureKinds", "[]", "must name at least one kind"},
		{"kinds not a list", "interfaces: [a]\ndefaults: {failureAccrual: {failureKinds: refused}}",
			"defaults.failureAccrual.failureKinds", `"refused"`, "want a list"},
		{"ejection percent over 100", "interfaces: [a]\ndefaults: {failureAccrual: {maxEjectionPercent: 101}}",
			"defaults.failureAccrual.maxEjectionPercent", "101", "must be within [0, 100]"},
		{"negative ejection percent", "interfaces: [a]\ndefaults: {failureAccrual: {maxEjectionPercent: -1}}",
			"defaults.failureAccrual.maxEjectionPercent", "-1", "must be within [0, 100]"},

		// upper bounds: nothing a service sets can overflow a penalty or
		// hold tracker memory for long
		{"max penalty beyond a day", "interfaces: [a]\ndefaults: {failureAccrual: {maxPenalty: 2562047h}}",
			"defaults.failureAccrual.maxPenalty", `"2562047h"`, "must be at most 24h0m0s"},
		{"max failures beyond the limit", "interfaces: [a]\ndefaults: {failureAccrual: {maxFailures: 9223372036854775807}}",
			"defaults.failureAccrual.maxFailures", "9223372036854775807", "must be at most 1000000"},
		{"connect timeout beyond 30s", svc(", failureAccrual: {connectTimeout: 1h}"),
			"services[0].failureAccrual.connectTimeout", `"1h"`, "must be at most 30s"},
		{"window beyond an hour", svc(", failureAccrual: {window: 2h}"),
			"services[0].failureAccrual.window", `"2h"`, "must be at most 1h0m0s"},
		{"outlier hosts beyond the limit", svc(", failureAccrual: {outlierMinHosts: 100001}"),
			"services[0].failureAccrual.outlierMinHosts", "100001", "must be at most 100000"},

		// service failureAccrual, validated on the merged result
		{"service jitter", svc(", failureAccrual: {jitterRatio: 1.5}"),
			"services[0].failureAccrual.jitterRatio", "1.5", "must be within [0, 1]"},
		{"service min over built-in max", svc(", failureAccrual: {minPenalty: 2m}"),
			"services[0].failureAccrual.minPenalty", `"2m"`, "must not exceed maxPenalty (1m0s)"},
		{"service max under inherited min", svc(", failureAccrual: {maxPenalty: 500ms}"),
			"services[0].failureAccrual.maxPenalty", `"500ms"`, "conflicts with inherited minPenalty: 1s: must not exceed maxPenalty (500ms)"},
		{"service max under defaults-block min",
			"interfaces: [a]\ndefaults: {failureAccrual: {minPenalty: 30s}}\nservices: [{name: x, vip: 198.18.0.1, port: 80, failureAccrual: {maxPenalty: 10s}}]",
			"services[0].failureAccrual.maxPenalty", `"10s"`, "conflicts with inherited minPenalty: 30s"},
		{"service consecutive over inherited empty kinds",
			"interfaces: [a]\ndefaults: {failureAccrual: {mode: none, failureKinds: []}}\nservices: [{name: x, vip: 198.18.0.1, port: 80, failureAccrual: {mode: consecutive}}]",
			"services[0].failureAccrual.mode", `"consecutive"`, "conflicts with inherited failureKinds: []: must name at least one kind"},
		{"service empty kinds", svc(", failureAccrual: {failureKinds: []}"),
			"services[0].failureAccrual.failureKinds", "[]", "must name at least one kind"},
		{"service unknown mode", svc(", failureAccrual: {mode: sometimes}"),
			"services[0].failureAccrual.mode", `"sometimes"`, "unknown mode"},
		{"service bad duration", svc(", failureAccrual: {connectTimeout: soon}"),
			"services[0].failureAccrual.connectTimeout", `"soon"`, "invalid duration"},

		// services
		{"services not a list", "interfaces: [a]\nservices: {name: web}", "services", `{"name":"web"}`, "want a list"},
		{"null service", "interfaces: [a]\nservices: [null]", "services[0]", "null", "want a mapping"},
		{"missing name", "interfaces: [a]\nservices: [{vip: 198.18.0.1, port: 80}]", "services[0].name", "", "required"},
		{"uppercase name", "interfaces: [a]\nservices: [{name: Web, vip: 198.18.0.1, port: 80}]", "services[0].name", `"Web"`, "must be at most 253 characters"},
		{"name ends with dash", "interfaces: [a]\nservices: [{name: web-, vip: 198.18.0.1, port: 80}]", "services[0].name", `"web-"`, "starting and ending"},
		{"name too long", "interfaces: [a]\nservices: [{name: " + strings.Repeat("a", 254) + ", vip: 198.18.0.1, port: 80}]",
			"services[0].name", `"` + strings.Repeat("a", 254) + `"`, "at most 253"},
		{"name read as bool", "interfaces: [a]\nservices: [{name: yes, vip: 198.18.0.1, port: 80}]", "services[0].name", "true", "quote it"},
		{"duplicate name", "interfaces: [a]\nservices: [{name: web, vip: 198.18.0.1, port: 80}, {name: web, vip: 198.18.0.2, port: 80}]",
			"services[1].name", `"web"`, "duplicate of services[0].name"},
		{"missing vip", "interfaces: [a]\nservices: [{name: web, port: 80}]", "services[0].vip", "", "required"},
		{"bad vip", "interfaces: [a]\nservices: [{name: web, vip: 198.18.0.256, port: 80}]", "services[0].vip", `"198.18.0.256"`, "not an IPv4 or IPv6 address"},
		{"vip with prefix", "interfaces: [a]\nservices: [{name: web, vip: 198.18.0.1/32, port: 80}]", "services[0].vip", `"198.18.0.1/32"`, "not an IPv4 or IPv6 address"},
		{"mapped vip", "interfaces: [a]\nservices: [{name: web, vip: '::ffff:198.18.0.1', port: 80}]", "services[0].vip", `"::ffff:198.18.0.1"`, "plain IPv4 (198.18.0.1)"},
		{"ipv6 vip in brackets", v6svc("'[2001:2::10]'", ""), "services[0].vip", `"[2001:2::10]"`, "without brackets"},
		{"ipv6 vip with prefix", v6svc("'2001:2::10/128'", ""), "services[0].vip", `"2001:2::10/128"`, "not an IPv4 or IPv6 address"},
		{"ipv6 unspecified vip", v6svc("'::'", ""), "services[0].vip", `"::"`, "unspecified"},
		{"ipv6 loopback vip", v6svc("'::1'", ""), "services[0].vip", `"::1"`, "loopback"},
		{"ipv6 multicast vip", v6svc("'ff02::1'", ""), "services[0].vip", `"ff02::1"`, "multicast"},
		{"ipv6 site multicast vip", v6svc("'ff05::1:3'", ""), "services[0].vip", `"ff05::1:3"`, "multicast"},
		{"ipv6 link-local vip", v6svc("'fe80::10'", ""), "services[0].vip", `"fe80::10"`, "link-local"},
		{"ipv6 vip with zone", v6svc("'fe80::10%eth0'", ""), "services[0].vip", `"fe80::10%eth0"`, "must not have a zone (%eth0)"},
		{"global ipv6 vip with zone", v6svc("'2001:2::10%eth0'", ""), "services[0].vip", `"2001:2::10%eth0"`, "must not have a zone"},
		{"duplicate ipv6 key, spelt differently",
			"interfaces: [a]\nservices: [{name: web, vip: '2001:2::10', port: 80}, {name: api, vip: '2001:2:0:0::0:10', port: 80}]",
			"services[1]", "[2001:2::10]:80/tcp", `service "api" uses the same VIP, port and protocol as service "web" (services[0])`},
		{"unspecified vip", "interfaces: [a]\nservices: [{name: web, vip: 0.0.0.0, port: 80}]", "services[0].vip", `"0.0.0.0"`, "unspecified"},
		{"loopback vip", "interfaces: [a]\nservices: [{name: web, vip: 127.0.0.53, port: 80}]", "services[0].vip", `"127.0.0.53"`, "loopback"},
		{"multicast vip", "interfaces: [a]\nservices: [{name: web, vip: 224.0.0.1, port: 80}]", "services[0].vip", `"224.0.0.1"`, "multicast"},
		{"broadcast vip", "interfaces: [a]\nservices: [{name: web, vip: 255.255.255.255, port: 80}]", "services[0].vip", `"255.255.255.255"`, "broadcast"},
		{"missing port", "interfaces: [a]\nservices: [{name: web, vip: 198.18.0.1}]", "services[0].port", "", "required"},
		{"zero port", "interfaces: [a]\nservices: [{name: web, vip: 198.18.0.1, port: 0}]", "services[0].port", "0", "must be within [1, 65535]"},
		{"port too big", "interfaces: [a]\nservices: [{name: web, vip: 198.18.0.1, port: 65536}]", "services[0].port", "65536", "must be within [1, 65535]"},
		{"negative port", "interfaces: [a]\nservices: [{name: web, vip: 198.18.0.1, port: -80}]", "services[0].port", "-80", "must be within [1, 65535]"},
		{"port as string", "interfaces: [a]\nservices: [{name: web, vip: 198.18.0.1, port: '80'}]", "services[0].port", `"80"`, "want an integer"},
		{"port as bool", "interfaces: [a]\nservices: [{name: web, vip: 198.18.0.1, port: true}]", "services[0].port", "true", "want an integer"},
		{"port huge", "interfaces: [a]\nservices: [{name: web, vip: 198.18.0.1, port: 99999999999999999999999}]", "services[0].port", "1e+23", "want an integer"},
		{"uppercase protocol", svc(", protocol: TCP"), "services[0].protocol", `"TCP"`, "unknown protocol (want tcp or udp, lowercase)"},
		{"unknown protocol", svc(", protocol: sctp"), "services[0].protocol", `"sctp"`, "unknown protocol"},
		{"duplicate key despite a bad name",
			"interfaces: [a]\nservices: [{name: web, vip: 198.18.0.1, port: 80}, {name: API, vip: 198.18.0.1, port: 80, protocol: tcp}]",
			"services[1]", "198.18.0.1:80/tcp", `service "API" uses the same VIP, port and protocol as service "web" (services[0])`},
		{"duplicate key",
			"interfaces: [a]\nservices: [{name: web, vip: 198.18.0.1, port: 80}, {name: api, vip: 198.18.0.1, port: 80, protocol: tcp}]",
			"services[1]", "198.18.0.1:80/tcp", `service "api" uses the same VIP, port and protocol as service "web" (services[0])`},

		// backends
		{"backend missing port", svc(", backends: ['198.18.1.2:80', '198.18.2.1:80', '198.18.2.2']"),
			"services[0].backends[2]", `"198.18.2.2"`, "missing port"},
		{"backend empty port", svc(", backends: ['198.18.2.2:']"), "services[0].backends[0]", `"198.18.2.2:"`, "missing port"},
		{"backend zero port", svc(", backends: ['198.18.2.2:0']"), "services[0].backends[0]", `"198.18.2.2:0"`, "port must be a number within [1, 65535]"},
		{"backend port too big", svc(", backends: ['198.18.2.2:65536']"), "services[0].backends[0]", `"198.18.2.2:65536"`, "port must be a number within [1, 65535]"},
		{"backend bad address", svc(", backends: ['198.18.2:80']"), "services[0].backends[0]", `"198.18.2:80"`, "want IPv4:port or [IPv6]:port"},
		{"backend hostname", svc(", backends: ['backend1:80']"), "services[0].backends[0]", `"backend1:80"`, "want IPv4:port or [IPv6]:port"},
		{"backend ipv4 in brackets", svc(", backends: ['[198.18.1.2]:80']"), "services[0].backends[0]", `"[198.18.1.2]:80"`, "write an IPv4 backend as 198.18.1.2:80"},
		{"backend mapped", svc(", backends: ['[::ffff:198.18.1.2]:80']"), "services[0].backends[0]", `"[::ffff:198.18.1.2]:80"`, "plain IPv4 (198.18.1.2)"},

		// IPv6 backends, and the one-family rule
		{"ipv6 backend of an ipv4 service", svc(", backends: ['198.18.1.2:80', '[2001:2::1:2]:80']"),
			"services[0].backends[1]", `"[2001:2::1:2]:80"`, "an IPv6 backend of an IPv4 service (vip 198.18.0.1): a service's vip and backends must be all IPv4 or all IPv6"},
		{"ipv4 backend of an ipv6 service", v6svc("'2001:2::10'", "'[2001:2::1:2]:80', '198.18.1.2:80'"),
			"services[0].backends[1]", `"198.18.1.2:80"`, "an IPv4 backend of an IPv6 service (vip 2001:2::10)"},
		{"mixed backends without a valid vip", v6svc("'2001:2::zz'", "'198.18.1.3:80', '198.18.1.2:80', '[2001:2::1:2]:80'"),
			"services[0].backends[2]", `"[2001:2::1:2]:80"`, "an IPv6 backend, but backends[0] is IPv4: a service's vip and backends must be all IPv4 or all IPv6"},
		{"ipv6 backend bare", v6svc("'2001:2::10'", "'2001:2::1:2'"), "services[0].backends[0]", `"2001:2::1:2"`, "missing port (an IPv6 backend is written [address]:port"},
		{"ipv6 backend brackets without port", v6svc("'2001:2::10'", "'[2001:2::1:2]'"), "services[0].backends[0]", `"[2001:2::1:2]"`, "missing port"},
		{"ipv6 backend empty port", v6svc("'2001:2::10'", "'[2001:2::1:2]:'"), "services[0].backends[0]", `"[2001:2::1:2]:"`, "missing port"},
		{"ipv6 backend zero port", v6svc("'2001:2::10'", "'[2001:2::1:2]:0'"), "services[0].backends[0]", `"[2001:2::1:2]:0"`, "port must be a number within [1, 65535]"},
		{"ipv6 backend port too big", v6svc("'2001:2::10'", "'[2001:2::1:2]:65536'"), "services[0].backends[0]", `"[2001:2::1:2]:65536"`, "port must be a number within [1, 65535]"},
		{"ipv6 backend bad address", v6svc("'2001:2::10'", "'[2001:2::1::2]:80'"), "services[0].backends[0]", `"[2001:2::1::2]:80"`, "want IPv4:port or [IPv6]:port"},
		{"ipv6 backend loopback", v6svc("'2001:2::10'", "'[::1]:80'"), "services[0].backends[0]", `"[::1]:80"`, "loopback"},
		{"ipv6 backend unspecified", v6svc("'2001:2::10'", "'[::]:80'"), "services[0].backends[0]", `"[::]:80"`, "unspecified"},
		{"ipv6 backend multicast", v6svc("'2001:2::10'", "'[ff02::2]:80'"), "services[0].backends[0]", `"[ff02::2]:80"`, "multicast"},
		{"ipv6 backend link-local", v6svc("'2001:2::10'", "'[fe80::2]:80'"), "services[0].backends[0]", `"[fe80::2]:80"`, "link-local"},
		{"ipv6 backend with zone", v6svc("'2001:2::10'", "'[fe80::2%b1]:80'"), "services[0].backends[0]", `"[fe80::2%b1]:80"`, "must not have a zone (%b1)"},
		{"ipv6 backend duplicate, spelt differently", v6svc("'2001:2::10'", "'[2001:2::1:2]:80', '[2001:2:0::1:2]:80'"),
			"services[0].backends[1]", `"[2001:2:0::1:2]:80"`, "duplicate of backends[0]"},
		{"backend loopback", svc(", backends: ['127.0.0.1:80']"), "services[0].backends[0]", `"127.0.0.1:80"`, "loopback"},
		{"backend duplicate", svc(", backends: ['198.18.1.2:80', '198.18.1.3:80', '198.18.1.2:80']"),
			"services[0].backends[2]", `"198.18.1.2:80"`, "duplicate of backends[0]"},
		{"backend as number", svc(", backends: [80]"), "services[0].backends[0]", "80", "want a string"},
		{"backends not a list", svc(", backends: '198.18.1.2:80'"), "services[0].backends", `"198.18.1.2:80"`, "want a list"},
		{"more backends than table slots", "interfaces: [a]\nmaglev: {tableSize: 7}\nservices: [{name: web, vip: 198.18.0.1, port: 80, backends: [" + manyBackends(8) + "]}]",
			"services[0].backends", "8 entries", "more than maglev.tableSize (7)"},
		{"too many backends", svc(", backends: [" + manyBackends(maxBackends+1) + "]"),
			"services[0].backends", "65536 entries", "at most 65535 backends"},

		// unknown fields, top-level and nested
		{"unknown top-level field", "interfaces: [a]\nservice: []", "service", "", "unknown field (want one of defaults, interfaces, maglev, redirectInterfaces, services)"},
		{"wrong case top-level field", "Interfaces: [a]", "Interfaces", "", `did you mean "interfaces"? keys are case-sensitive`},
		{"unknown maglev field", "interfaces: [a]\nmaglev: {size: 7}", "maglev.size", "", "unknown field (want one of tableSize)"},
		{"unknown defaults field", "interfaces: [a]\ndefaults: {accrual: {}}", "defaults.accrual", "", "unknown field"},
		{"unknown accrual field", "interfaces: [a]\ndefaults: {failureAccrual: {maxFailure: 3}}", "defaults.failureAccrual.maxFailure", "", "unknown field"},
		{"unknown service field", svc(", weight: 3"), "services[0].weight", "", "unknown field"},
		{"unknown service accrual field", "interfaces: [a]\nservices: [{name: a, vip: 198.18.0.1, port: 80}, {name: b, vip: 198.18.0.2, port: 80, failureAccrual: {jitter: 0.1}}]",
			"services[1].failureAccrual.jitter", "", "unknown field"},
		{"numeric key", svc(", 1: x"), "services[0].1", "", "unknown field"},
		// window rules
		{"both rate spellings", "interfaces: [a]\ndefaults: {failureAccrual: {failureRateThreshold: 0.2, successRateThreshold: 0.8}}",
			"defaults.failureAccrual.successRateThreshold", "0.8", "not both"},
		{"success rate of nearly 1", "interfaces: [a]\ndefaults: {failureAccrual: {successRateThreshold: 0.9999999999999}}",
			"defaults.failureAccrual.successRateThreshold", "0.9999999999999", "must be within (0, 1)"},
		{"success rate above 1", "interfaces: [a]\ndefaults: {failureAccrual: {successRateThreshold: 80}}",
			"defaults.failureAccrual.successRateThreshold", "80", "must be within (0, 1)"},
		{"failure rate of 1", "interfaces: [a]\ndefaults: {failureAccrual: {mode: failure-rate, failureRateThreshold: 1}}",
			"defaults.failureAccrual.failureRateThreshold", "1", "must be within (0, 1)"},
		{"window too short", "interfaces: [a]\ndefaults: {failureAccrual: {window: 5ms}}",
			"defaults.failureAccrual.window", `"5ms"`, "at least 10ms"},
		{"min calls beyond a count window", "interfaces: [a]\ndefaults: {failureAccrual: {windowCalls: 4}}",
			"defaults.failureAccrual.windowCalls", "4", "conflicts with inherited minCalls"},
		{"slow connect as slow as a timeout", "interfaces: [a]\ndefaults: {failureAccrual: {slowConnectThreshold: 1s}}",
			"defaults.failureAccrual.slowConnectThreshold", `"1s"`, "must be below connectTimeout"},
		{"outliers not a bool", "interfaces: [a]\ndefaults: {failureAccrual: {outliers: 'yes'}}",
			"defaults.failureAccrual.outliers", `"yes"`, "want"},
		{"one outlier host", "interfaces: [a]\ndefaults: {failureAccrual: {outlierMinHosts: 1}}",
			"defaults.failureAccrual.outlierMinHosts", "1", "at least 2"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Parse([]byte(tt.doc))
			if err == nil {
				t.Fatalf("Parse(%q) = %+v, want an error", tt.doc, c)
			}
			if c != nil {
				t.Errorf("Parse returned a Config with the error")
			}
			fe := findFieldError(err, tt.path)
			if fe == nil {
				t.Fatalf("no error at %s in:\n%v", tt.path, err)
			}
			if fe.Value != tt.value {
				t.Errorf("value = %q, want %q", fe.Value, tt.value)
			}
			prefix := tt.path + ": "
			if tt.value != "" {
				prefix += tt.value + ": "
			}
			if text := fe.Error(); !strings.HasPrefix(text, prefix) || !strings.Contains(text, tt.msg) {
				t.Errorf("error = %q, want %q...%q", text, prefix, tt.msg)
			}
			if !strings.Contains(err.Error(), fe.Error()) {
				t.Errorf("joined error %q lacks %q", err, fe)
			}
		})
	}
}

func manyBackends(n int) string {
	var b strings.Builder
	for i := range n {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "'10.%d.%d.1:80'", i>>8, i&0xff)
	}
	return b.String()
}

// findFieldError returns the FieldError at path among the joined errors.
func findFieldError(err error, path string) *FieldError {
	var errs []error
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		errs = j.Unwrap()
	} else {
		errs = []error{err}
	}
	for _, e := range errs {
		var fe *FieldError
		if errors.As(e, &fe) && fe.Path == path {
			return fe
		}
	}
	return nil
}

// TestDocumentErrors covers errors about the document as a whole, which
// have no field path.
func TestDocumentErrors(t *testing.T) {
	tests := []struct{ name, doc, want string }{
		{"empty", "", "config is empty"},
		{"only a comment", "# nothing here\n", "config is empty"},
		{"null document", "~", "config is empty"},
		{"list at top level", "- eth0", `top level: ["eth0"]: want a mapping`},
		{"scalar at top level", "eth0", `top level: "eth0": want a mapping`},
		{"syntax error", "interfaces: [a", "invalid YAML"},
		{"duplicate key", "interfaces: [a]\ninterfaces: [b]\n", `key "interfaces" already set`},
		{"duplicate nested key", svc(", name: api"), `key "name" already set`},
		{"second document", "interfaces: [a]\n---\nservices: []\n", "line 2: a second YAML document"},
		{"document after end marker", "interfaces: [a]\n...\n# c\nservices: []\n", "line 4: a second YAML document"},
		{"second document inline", "--- {interfaces: [a]}\n--- {services: []}\n", "line 2: a second YAML document"},
		{"nan", "interfaces: [a]\ndefaults: {failureAccrual: {jitterRatio: .nan}}", "NaN is not a usable number"},
		{"inf", "interfaces: [a]\ndefaults: {failureAccrual: {jitterRatio: .inf}}", "Inf is not a usable number"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Parse([]byte(tt.doc))
			if err == nil || c != nil {
				t.Fatalf("Parse(%q) = %+v, %v; want an error", tt.doc, c, err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error = %q, want it to contain %q", err, tt.want)
			}
		})
	}
}

// TestAllErrorsReported checks that one Parse reports independent problems
// together, in file order, and caps a long list.
func TestAllErrorsReported(t *testing.T) {
	doc := "interfaces: [a, a]\nmaglev: {tableSize: 8}\n" +
		"services: [{name: web, vip: 198.18.0.1, port: 0}, {name: api, vip: '::1', port: 80}]"
	_, err := Parse([]byte(doc))
	if err == nil {
		t.Fatal("no error")
	}
	want := []string{"interfaces[1]", "maglev.tableSize", "services[0].port", "services[1].vip"}
	lines := strings.Split(err.Error(), "\n")
	if len(lines) != len(want) {
		t.Fatalf("got %d errors, want %d:\n%v", len(lines), len(want), err)
	}
	for i, w := range want {
		if !strings.HasPrefix(lines[i], w+": ") {
			t.Errorf("error %d = %q, want path %s", i, lines[i], w)
		}
	}

	// A broken defaults block is reported once, not per service.
	doc = "interfaces: [a]\ndefaults: {failureAccrual: {jitterRatio: 2}}\n" +
		"services: [{name: web, vip: 198.18.0.1, port: 80}, {name: api, vip: 198.18.0.2, port: 80}]"
	if _, err := Parse([]byte(doc)); err == nil || strings.Count(err.Error(), "\n") != 0 {
		t.Errorf("want exactly one error, got:\n%v", err)
	}

	// 100 bad backends: maxErrors of them, then a count of the rest.
	bad := strings.TrimSuffix(strings.Repeat("'198.18.0.1', ", 100), ", ")
	_, err = Parse([]byte(svc(", backends: [" + bad + "]")))
	lines = strings.Split(fmt.Sprint(err), "\n")
	if len(lines) != maxErrors+1 || lines[maxErrors] != fmt.Sprintf("... and %d more errors", 100-maxErrors) {
		t.Errorf("got %d lines, last %q", len(lines), lines[len(lines)-1])
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()

	missing := filepath.Join(dir, "missing.yaml")
	if _, err := Load(missing); err == nil || !strings.Contains(err.Error(), missing) {
		t.Errorf("Load(missing) error = %v, want it to name %s", err, missing)
	}

	bad := filepath.Join(dir, "bad.yaml")
	if err := os.WriteFile(bad, []byte("interfaces: [a]\nmaglev: {tableSize: 8}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := Load(bad)
	if err == nil || !strings.Contains(err.Error(), bad) || !strings.Contains(err.Error(), "maglev.tableSize: 8: must be prime") {
		t.Errorf("Load(bad) error = %v, want it to name %s and the field", err, bad)
	}
	var fe *FieldError
	if !errors.As(err, &fe) || fe.Path != "maglev.tableSize" {
		t.Errorf("errors.As(FieldError) = %v", fe)
	}
}

func TestIsPrime(t *testing.T) {
	primes := map[int]bool{2: true, 3: true, 5: true, 7: true, 11: true, 13: true}
	for n := -1; n < 15; n++ {
		if isPrime(n) != primes[n] {
			t.Errorf("isPrime(%d) = %v", n, isPrime(n))
		}
	}
	for _, n := range []int{DefaultMaglevTableSize, 65537, maxMaglevTableSize, minMaglevTableSize} {
		if !isPrime(n) {
			t.Errorf("isPrime(%d) = false", n)
		}
	}
	for _, n := range []int{16383, 65535, 1048575, 7 * 7, 1021 * 1021} {
		if isPrime(n) {
			t.Errorf("isPrime(%d) = true", n)
		}
	}
	// maxMaglevTableSize is the largest prime the limit allows.
	for n := maxMaglevTableSize + 1; n < 1<<20; n++ {
		if isPrime(n) {
			t.Errorf("%d is prime and below 2^20", n)
		}
	}
}

func TestFieldErrorFormat(t *testing.T) {
	if got := (&FieldError{Path: "a.b", Msg: "required"}).Error(); got != "a.b: required" {
		t.Error(got)
	}
	if got := (&FieldError{Path: "a[0]", Value: `"x"`, Msg: "bad"}).Error(); got != `a[0]: "x": bad` {
		t.Error(got)
	}
}

// TestCheckShapeUint covers unsigned fields, which the schema has none of
// yet but counters like maxInflight will.
func TestCheckShapeUint(t *testing.T) {
	type withUint struct {
		N *uint32 `json:"n"`
	}
	tests := map[string]string{
		`{"n": 4294967295}`: "",
		`{"n": -1}`:         "n: -1: want an integer within [0, 4294967295]",
		`{"n": 4294967296}`: "n: 4294967296: want an integer within [0, 4294967295]",
		`{"n": "5"}`:        `n: "5": want an integer`,
	}
	for doc, want := range tests {
		d := json.NewDecoder(strings.NewReader(doc))
		d.UseNumber()
		var tree any
		if err := d.Decode(&tree); err != nil {
			t.Fatal(err)
		}
		var errs errList
		checkShape("", tree, reflect.TypeFor[withUint](), &errs)
		if got := fmt.Sprint(errs.err()); (want == "" && errs.count() != 0) || (want != "" && got != want) {
			t.Errorf("%s: got %q, want %q", doc, got, want)
		}
	}
}

func TestMaxInflightLimits(t *testing.T) {
	base := `interfaces: [cl0]
defaults:
  maxInflight: 100
services:
  - name: inherits
    vip: 198.18.100.1
    port: 80
    backends: ["198.18.1.2:8080"]
  - name: own
    vip: 198.18.100.2
    port: 80
    maxInflight: 20
    maxInflightPerEndpoint: 5
    backends: ["198.18.1.2:8080"]
  - name: unlimited
    vip: 198.18.100.3
    port: 80
    maxInflight: 0
    backends: ["198.18.1.2:8080"]
`
	c, err := Parse([]byte(base))
	if err != nil {
		t.Fatal(err)
	}
	st := c.Desired()
	got := [][2]uint32{}
	for _, s := range st.Services {
		got = append(got, [2]uint32{s.MaxInflight, s.MaxInflightPerEndpoint})
	}
	want := [][2]uint32{{100, 0}, {20, 5}, {0, 0}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("limits %v, want %v", got, want)
	}

	// Without defaults.maxInflight the file leaves the default to the flag.
	c, err = Parse([]byte(strings.Replace(base, "defaults:\n  maxInflight: 100\n", "", 1)))
	if err != nil {
		t.Fatal(err)
	}
	if c.MaxInflight != nil || c.Desired().Services[0].MaxInflight != 0 {
		t.Fatalf("unset default: %v", c.MaxInflight)
	}

	for _, bad := range []struct{ from, to, want string }{
		{"maxInflight: 20", "maxInflight: -1", `services[1].maxInflight: -1: must be within [0, 4294967295]`},
		{"maxInflightPerEndpoint: 5", "maxInflightPerEndpoint: 5000000000", `services[1].maxInflightPerEndpoint: 5000000000: must be within`},
		{"  maxInflight: 100", "  maxInflight: -3", `defaults.maxInflight: -3: must be within`},
		{"maxInflight: 20", `maxInflight: "20"`, `services[1].maxInflight`},
	} {
		_, err := Parse([]byte(strings.Replace(base, bad.from, bad.to, 1)))
		if err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%s: error %v, want it to contain %q", bad.to, err, bad.want)
		}
	}
}

func TestRetryRefused(t *testing.T) {
	base := `interfaces: [cl0]
defaults:
  retryRefused: true
services:
  - name: inherits
    vip: 198.18.100.1
    port: 80
    backends: ["198.18.1.2:8080"]
  - name: own
    vip: 198.18.100.2
    port: 80
    retryRefused: false
    backends: ["198.18.1.2:8080"]
`
	c, err := Parse([]byte(base))
	if err != nil {
		t.Fatal(err)
	}
	st := c.Desired()
	if !st.Services[0].RetryRefused || st.Services[1].RetryRefused {
		t.Fatalf("retryRefused = %v, %v; want true (inherited), false (own)", st.Services[0].RetryRefused, st.Services[1].RetryRefused)
	}
	_, err = Parse([]byte(strings.Replace(base, "retryRefused: false", `retryRefused: "no"`, 1)))
	if err == nil || !strings.Contains(err.Error(), "services[1].retryRefused") {
		t.Fatalf("a string for a bool: %v", err)
	}
}

func TestWindowSettings(t *testing.T) {
	c, err := Parse([]byte(`interfaces: [a]
defaults:
  failureAccrual:
    mode: unified
    window: 30s
    minCalls: 20
    successRateThreshold: 0.9
    slowConnectThreshold: 50ms
    slowConnectRateThreshold: 0.3
services:
  - name: web
    vip: 198.18.100.1
    port: 80
    failureAccrual:
      windowCalls: 100
      outliers: true
      outlierStdevFactor: 2.5
      outlierMinHosts: 3
      outlierMinCalls: 50
`))
	if err != nil {
		t.Fatal(err)
	}
	got := c.Services[0].Accrual
	want := accrual.Defaults()
	want.Mode = accrual.ModeUnified
	want.Window, want.MinCalls, want.FailureRateThreshold = 30*time.Second, 20, 1-0.9
	want.SlowConnectThreshold, want.SlowConnectRateThreshold = 50*time.Millisecond, 0.3
	want.WindowCalls, want.Outliers, want.OutlierStdevFactor, want.OutlierMinHosts, want.OutlierMinCalls = 100, true, 2.5, 3, 50
	if got != want {
		t.Fatalf("settings\n got %+v\nwant %+v", got, want)
	}
}

// IPv6 services: the VIP bare, backends in brackets, normalized to
// netip's form; an IPv4 and an IPv6 service may share a port and
// protocol (their keys differ by VIP).
func TestIPv6Services(t *testing.T) {
	doc := `interfaces: [eth0]
services:
  - name: web
    vip: 198.18.100.1
    port: 80
    backends: ["198.18.1.2:8080"]
  - name: web6
    vip: "2001:2::10"
    port: 80
    backends: ["[2001:2::1:2]:8080", "[2001:2:0:0::2:2]:8080", "[2001:DB8::3]:8080"]
  - name: dns6
    vip: "fd00:100::53"
    port: 53
    protocol: udp
    backends: ["[fd00:1::53]:53"]
  - name: empty6
    vip: "2001:2::11"
    port: 80
`
	c, err := Parse([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	type svcWant struct {
		key string
		eps []string
	}
	want := []svcWant{
		{"198.18.100.1:80/tcp", []string{"198.18.1.2:8080"}},
		{"[2001:2::10]:80/tcp", []string{"[2001:2::1:2]:8080", "[2001:2::2:2]:8080", "[2001:db8::3]:8080"}},
		{"[fd00:100::53]:53/udp", []string{"[fd00:1::53]:53"}},
		{"[2001:2::11]:80/tcp", []string{}},
	}
	got := c.Desired().Services
	if len(got) != len(want) {
		t.Fatalf("%d services, want %d", len(got), len(want))
	}
	for i, w := range want {
		s := got[i]
		if s.Key.String() != w.key {
			t.Errorf("service %s: key %s, want %s", s.Name, s.Key, w.key)
		}
		eps := []string{}
		for _, e := range s.Endpoints {
			eps = append(eps, e.Addr.String())
			if e.Addr.Addr().Is4() != s.Key.VIP.Is4() {
				t.Errorf("service %s: endpoint %s not of the VIP's family", s.Name, e.Addr)
			}
		}
		if !reflect.DeepEqual(eps, w.eps) {
			t.Errorf("service %s: endpoints %v, want %v", s.Name, eps, w.eps)
		}
	}
	// IPv4 link-local VIPs (node-local addresses) stay allowed; IPv6
	// unique-local and global ones are fine.
	for _, vip := range []string{"169.254.20.10", "'fd00::1'", "'2001:db8::1'", "'64:ff9b::c612:6401'"} {
		if _, err := Parse([]byte("interfaces: [a]\nservices: [{name: x, vip: " + vip + ", port: 80}]")); err != nil {
			t.Errorf("vip %s: %v", vip, err)
		}
	}
}

// sessionAffinity is a duration per service, within Kubernetes' bounds;
// a bad one names the field and the value.
func TestSessionAffinity(t *testing.T) {
	base := `interfaces: [cl0]
services:
  - name: sticky
    vip: 198.18.100.1
    port: 80
    sessionAffinity: 10m
    backends: ["198.18.1.2:8080"]
  - name: loose
    vip: 198.18.100.2
    port: 80
    backends: ["198.18.1.2:8080"]
`
	c, err := Parse([]byte(base))
	if err != nil {
		t.Fatal(err)
	}
	st := c.Desired()
	if st.Services[0].Affinity != 10*time.Minute || st.Services[1].Affinity != 0 {
		t.Fatalf("affinity = %v, %v; want 10m, none", st.Services[0].Affinity, st.Services[1].Affinity)
	}
	for value, want := range map[string]string{
		"25h":    `services[0].sessionAffinity: "25h0m0s": must be within [0s, 24h]`,
		"-1s":    `services[0].sessionAffinity: "-1s": must be within [0s, 24h]`,
		"sticky": `services[0].sessionAffinity: "sticky": invalid duration`,
	} {
		_, err := Parse([]byte(strings.Replace(base, "sessionAffinity: 10m", "sessionAffinity: "+value, 1)))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("sessionAffinity %s: %v, want %q", value, err, want)
		}
	}
}

// The config file the docs start the agent with parses.
func TestShippedExample(t *testing.T) {
	c, err := Load("../../examples/standalone.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Desired().Services) == 0 {
		t.Error("examples/standalone.yaml has no service")
	}
}
