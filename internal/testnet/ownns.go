// SPDX-License-Identifier: Apache-2.0

package testnet

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// OwnNetns moves the test's goroutine, locked to its thread, into a new
// network namespace for the rest of the test, and returns a netlink
// handle there: what runs on that thread (a BPF program run, a netlink
// call) sees that namespace, and the host's is never touched. It skips
// the test without root, and without the kernel's conntrack when
// conntrack is set (nf_conntrack and nf_conntrack_netlink).
func OwnNetns(t *testing.T, conntrack bool) *netlink.Handle {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root for a network namespace")
	}
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	ns, err := netns.New()
	if err != nil {
		orig.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := netns.Set(orig); err != nil {
			t.Errorf("back to the original namespace: %v", err)
			return // the thread stays locked: Go retires it
		}
		orig.Close()
		ns.Close()
		runtime.UnlockOSThread()
	})
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Close)
	if conntrack {
		if _, err := h.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET); err != nil {
			t.Skipf("the kernel has no conntrack to test against (nf_conntrack, nf_conntrack_netlink): %v", err)
		}
	}
	return h
}

// WaitOperUp waits, up to timeout, until the links named are
// operationally up in h's namespace. A veth end set up before its peer
// drops what it sends, silently, until the kernel's linkwatch worker
// activates its queueing discipline and sets the operstate (see
// Topology.waitOperUp): on a slow VM long enough to lose a test's first
// packet.
func WaitOperUp(h *netlink.Handle, timeout time.Duration, names ...string) error {
	deadline := time.Now().Add(timeout)
	for _, name := range names {
		for {
			l, err := h.LinkByName(name)
			if err != nil {
				return err
			}
			if l.Attrs().OperState == netlink.OperUp {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("testnet: %s not operationally up after %v (%s)", name, timeout, l.Attrs().OperState)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	return nil
}

// AddConntrack inserts a conntrack entry through h as the kernel would
// have made it: seen as orig, answered as reply, of protocol proto (TCP or
// UDP) with info (nil: none), for two minutes.
func AddConntrack(h *netlink.Handle, orig, reply [2]netip.AddrPort, proto uint8, info netlink.ProtoInfo) error {
	family := netlink.InetFamily(unix.AF_INET)
	if orig[0].Addr().Is6() {
		family = unix.AF_INET6
	}
	tuple := func(ap [2]netip.AddrPort) netlink.IPTuple {
		return netlink.IPTuple{SrcIP: net.IP(ap[0].Addr().AsSlice()), DstIP: net.IP(ap[1].Addr().AsSlice()),
			SrcPort: ap[0].Port(), DstPort: ap[1].Port(), Protocol: proto}
	}
	return h.ConntrackCreate(netlink.ConntrackTable, family, &netlink.ConntrackFlow{FamilyType: uint8(family),
		Forward: tuple(orig), Reverse: tuple(reply), TimeOut: 120, ProtoInfo: info})
}
