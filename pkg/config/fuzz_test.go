// SPDX-License-Identifier: Apache-2.0

package config

import (
	"os"
	"testing"
)

// FuzzParse checks that no input makes Parse panic, and that whatever it
// accepts is usable: valid accrual settings, a prime table, keys of one
// family each (IPv4, or IPv6 without a zone or a mapped IPv4 address).
func FuzzParse(f *testing.F) {
	example, err := os.ReadFile("testdata/example.yaml")
	if err != nil {
		f.Fatal(err)
	}
	for _, seed := range []string{
		string(example),
		"",
		"interfaces: [eth0]",
		svc(", backends: ['198.18.1.2:80'], failureAccrual: {mode: none, failureKinds: []}"),
		svc(", failureAccrual: {minPenalty: 2m}"),
		"interfaces: [a]\ndefaults: {failureAccrual: {jitterRatio: .nan, maxFailures: 1e300}}",
		"interfaces: [a]\nmaglev: {tableSize: 18446744073709551617}",
		"a: &x [*x]",
		"interfaces: &a [eth0]\nredirectInterfaces: *a\n",
		"- - - -\n",
		"{? [a]: b}",
		"interfaces: !!binary aGVsbG8=",
		"interfaces: [a]\nservices: [{name: x, vip: '2001:2::10', port: 80, backends: ['[2001:2::1:2]:8080', '198.18.1.2:80']}]",
		"interfaces: [a]\nservices: [{name: x, vip: 'fe80::1%a', port: 80, backends: ['[::ffff:1.2.3.4]:80']}]",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Parse(data)
		if err != nil {
			if c != nil {
				t.Fatal("Config returned with an error")
			}
			if err.Error() == "" {
				t.Fatal("empty error message")
			}
			return
		}
		if len(c.Interfaces) == 0 || !isPrime(int(c.MaglevTableSize)) {
			t.Fatalf("accepted %+v", c)
		}
		if err := c.Defaults.Validate(); err != nil {
			t.Fatalf("accepted invalid defaults: %v", err)
		}
		for _, s := range c.Desired().Services {
			if err := s.Accrual.Validate(); err != nil {
				t.Fatalf("service %q: accepted invalid accrual: %v", s.Name, err)
			}
			vip := s.Key.VIP
			if !vip.IsValid() || vip.Is4In6() || vip.Zone() != "" || s.Key.Port == 0 {
				t.Fatalf("service %q: accepted key %v", s.Name, s.Key)
			}
			for _, e := range s.Endpoints {
				a := e.Addr.Addr()
				if a.Is4() != vip.Is4() || a.Is4In6() || a.Zone() != "" || e.Addr.Port() == 0 {
					t.Fatalf("service %q: accepted endpoint %v", s.Name, e.Addr)
				}
			}
		}
	})
}
