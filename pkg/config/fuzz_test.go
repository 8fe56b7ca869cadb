package config

import (
	"os"
	"testing"
)

// FuzzParse checks that no input makes Parse panic, and that whatever it
// accepts is usable: valid accrual settings, a prime table, IPv4 keys.
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
			if !s.Key.VIP.Is4() || s.Key.Port == 0 {
				t.Fatalf("service %q: accepted key %v", s.Name, s.Key)
			}
			for _, e := range s.Endpoints {
				if !e.Addr.Addr().Is4() || e.Addr.Port() == 0 {
					t.Fatalf("service %q: accepted endpoint %v", s.Name, e.Addr)
				}
			}
		}
	})
}
