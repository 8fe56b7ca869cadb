// SPDX-License-Identifier: Apache-2.0

package desired

import (
	"net/netip"
	"testing"
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
