// Package testnet builds the network that penaltybox's BPF end-to-end tests,
// `make demo` and the benchmarks run on: a "node" network namespace (where
// the agent runs and XDP attaches to cl0, b1..bN) wired by veth pairs to a
// client namespace and N backend namespaces with real servers on real
// sockets. Only addresses in 198.18.0.0/15 are used; nothing in the host's
// own namespace (interfaces, routes, sysctls) is touched.
//
//	client eth0 198.18.0.2/24 ── cl0 198.18.0.1/24 ┐
//	                                              node  (VIP 198.18.100.1: on no interface)
//	b<i>   eth0 198.18.i.2/24 ── b<i> 198.18.i.1/24 ┘
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
//	topo.Backend(2).SetMode(testnet.Refuse)
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
//     a VIP fail with "network unreachable" (class Unreachable).
//   - Build waits until every link has carried a packet both ways (a fresh
//     veth end can drop its first packets for a few milliseconds), so tests
//     may send at once. The probe leaves ARP entries on both ends.
//   - Topologies left behind by a killed test binary are removed by the next
//     Build (CleanupStale), judged by the creator PID in their names and the
//     registry under /run/penaltybox-testnet.
//   - A socket created in a namespace keeps it alive (anonymously, after
//     Close removed its name) until the socket is closed.
package testnet
