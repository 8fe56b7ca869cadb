// SPDX-License-Identifier: Apache-2.0

// Package testnet builds the network that penaltybox's BPF end-to-end tests,
// `make demo` and the benchmarks run on: a "node" network namespace (where
// the agent runs and XDP attaches to cl0, b1..bN) wired by veth pairs to a
// client namespace and N backend namespaces with real servers on real
// sockets. Every link is dual-stack, IPv4 and IPv6. Only test addresses are
// used, 198.18.0.0/15 (RFC 2544) and 2001:2::/48 (RFC 5180); nothing in
// the host's own namespace (interfaces, routes, sysctls) is touched.
//
//	client eth0 198.18.0.2/24    ── cl0  198.18.0.1/24    ┐
//	            2001:2:0:0::2/64         2001:2:0:0::1/64 │
//	                                                      node  (VIP  198.18.100.1,
//	b<i>   eth0 198.18.i.2/24    ── b<i> 198.18.i.1/24    │        VIP6 2001:2:0:100::1:
//	            2001:2:0:i::2/64         2001:2:0:i::1/64 ┘        on no interface)
//
// The fourth group of an IPv6 address spells the link's index with the
// same decimal digits as the third byte of its IPv4 address: b12's eth0 is
// 198.18.12.2 and 2001:2:0:12::2 (2001:2:0:0::2 is 2001:2::2). The client
// and the backends have a default route of each family via the node's
// address on their link; the node forwards both. IPv6 addresses are added
// without duplicate address detection and no namespace takes router
// advertisements, so the addresses and routes are static and usable at
// once. Backend servers listen on both families.
//
// Typical use:
//
//	topo := testnet.New(t, testnet.XDPOptions(3)) // skips if not root; Close via t.Cleanup
//	for _, b := range topo.Backends {
//		b.ServeHTTP(80) // answers "b1\n", "b2\n", ...
//	}
//	// ... start the agent in topo.Node (NS.Start), attach XDP to topo.NodeIfaces() ...
//	rs, _ := testnet.Load(ctx, topo.Client, testnet.LoadSpec{
//		Target: testnet.VIP + ":80", Rate: 200, Duration: 5 * time.Second,
//		ConnectTimeout: 300 * time.Millisecond,
//	})
//	// The same over IPv6: the address in brackets ("[2001:2:0:100::1]:80").
//	rs6, _ := testnet.Load(ctx, topo.Client, testnet.LoadSpec{
//		Target: "[" + testnet.VIP6 + "]:80", Rate: 200, Duration: 5 * time.Second,
//	})
//	topo.Backend(2).SetMode(testnet.Refuse) // for IPv4 and IPv6 clients alike
//
// Gotchas
//
//   - Namespaces are per thread. NS.Do runs a function on a locked thread
//     inside the namespace; goroutines it starts are NOT in the namespace.
//     A socket keeps the namespace it was created in, so create sockets
//     through Listen, ListenPacket, Dialer/DialContext, HTTPClient/HTTPGet or
//     Load, and then use them from any goroutine.
//   - NS.Command and NS.Run use `ip netns exec`, which gives the program its
//     own mount namespace with a fresh /sys: bpffs pins it makes vanish with
//     it. Start a program that must pin BPF objects on the host's
//     /sys/fs/bpf (the agent) with NS.Start. Two topologies' agents pinning
//     to the same path will collide: give each its own pin directory.
//   - XDP_REDIRECT into a veth drops frames unless the peer end has an XDP
//     program or GRO enabled (Options.GRO; it must be switched on after the
//     link is up, which Build does), and a redirected frame loses its
//     CHECKSUM_PARTIAL mark, so the sending end must not offload checksums
//     (Options.TxChecksumOff). XDPOptions sets both (and static neighbours);
//     TestXDPRedirectNeedsGROAndFullChecksums demonstrates all three cases.
//   - Without a load balancer the node has no route to the VIPs: connects to
//     a VIP or VIP6 fail with "network unreachable" (class Unreachable). The
//     node rate-limits these ICMP errors (measured on the 6.18 test VM:
//     IPv4 a burst of two, then one a second; IPv6 a burst of about six,
//     then one every 25 ms), so of many attempts in quick succession the later ones
//     see their SYN unanswered (ConnectTimeout, or Unreachable only once
//     the SYN retransmission a second later is answered).
//   - Build waits until every link has carried a packet both ways, over
//     IPv4 and over IPv6 (a fresh veth end can drop its first packets for a
//     few milliseconds), so tests may send at once. The probes leave ARP
//     and NDP entries on both ends (permanent ones with
//     Options.StaticNeighbors).
//   - Write IPv6 addresses in brackets wherever a port follows:
//     "[2001:2:0:1::2]:80", "http://[2001:2:0:1::2]/" (netip.AddrPort's
//     String does). DialContext and Load take literal addresses only.
//   - IPv4 only: SYNFlood and FloodSources.
//   - Topologies left behind by a killed test binary are removed by the next
//     Build (CleanupStale), judged by the creator PID in their names and the
//     registry under /run/penaltybox-testnet.
//   - A socket created in a namespace keeps it alive (anonymously, after
//     Close removed its name) until the socket is closed.
package testnet
