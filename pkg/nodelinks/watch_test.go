// SPDX-License-Identifier: Apache-2.0

package nodelinks_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/penaltybox/penaltybox/internal/testnet"
	"github.com/penaltybox/penaltybox/pkg/nodelinks"
)

// A CNI such as the bridge plugin creates a pod's veth and only then makes
// the bridge its master. The datapath takes a bridged pod's replies only
// through the bridge (the reverse-path check), so the watch must report
// the master's arrival, though no link came or went: before, it did not,
// pb_ifaces kept the veth without master, and every reply of that pod was
// refused for good (TestSeedDemoOnACluster: a pod's refusals seen as
// timeouts, twice in CI). Another change of the veth keeps its master;
// out of the bridge again, the veth stays listed, without master. (The
// bridge's own notifications, which the watch skips, say the port is
// deleted; here they came together with the link's own and were
// coalesced, so this run passes without the skip too.)
func TestWatchReportsAMasterSetLater(t *testing.T) {
	h := testnet.OwnNetns(t, false)
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "pbbr0"}}
	if err := h.LinkAdd(br); err != nil {
		t.Fatal(err)
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "vethpb0"}, PeerName: "pbpeer0"}
	if err := h.LinkAdd(veth); err != nil {
		t.Fatal(err)
	}
	brLink, err := h.LinkByName("pbbr0")
	if err != nil {
		t.Fatal(err)
	}
	vethLink, err := h.LinkByName("vethpb0")
	if err != nil {
		t.Fatal(err)
	}
	master := brLink.Attrs().Index

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out := make(chan nodelinks.Update, 16)
	var got []int // the veth's master in each update
	bumped, released := false, false
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer cancel()
		for {
			select {
			case <-ctx.Done():
				return
			case u := <-out:
				i := slices.IndexFunc(u.Links, func(l nodelinks.Link) bool { return l.Name == "vethpb0" })
				if i < 0 {
					t.Errorf("update without the veth: %+v", u.Links)
					return
				}
				got = append(got, u.Links[i].Master)
				second := slices.ContainsFunc(u.Links, func(l nodelinks.Link) bool { return l.Name == "vethpb1" })
				switch {
				case len(got) == 1:
					// The first update is the state listed at start.
					if err := h.LinkSetMaster(vethLink, brLink); err != nil {
						t.Error(err)
						return
					}
				case !bumped && u.Links[i].Master == master:
					// Another change of the veth (up) must keep its
					// master; a second veth's arrival, after it on the
					// same socket, makes an update that shows it.
					bumped = true
					if err := h.LinkSetUp(vethLink); err != nil {
						t.Error(err)
						return
					}
					if err := h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "vethpb1"}, PeerName: "pbpeer1"}); err != nil {
						t.Error(err)
						return
					}
				case bumped && !released:
					if u.Links[i].Master != master {
						t.Errorf("the veth's master %d after it came up, want %d still", u.Links[i].Master, master)
						return
					}
					if !second {
						continue
					}
					// Out of the bridge again: the bridge's own
					// notification of it is a deletion, and the veth
					// must stay.
					released = true
					if err := h.LinkSetNoMaster(vethLink); err != nil {
						t.Error(err)
						return
					}
				case u.Links[i].Master == 0 && released:
					return
				}
			}
		}
	}()
	// Watch runs on this goroutine: its thread is in the namespace.
	if err := nodelinks.Watch(ctx, nodelinks.Options{Pods: []string{"veth*"}}, out); err != nil {
		t.Fatal(err)
	}
	<-done
	if len(got) < 4 || got[0] != 0 || !slices.Contains(got, master) || got[len(got)-1] != 0 || !bumped || !released {
		t.Errorf("the veth's master in the updates: %v; want 0 first, then the bridge's ifindex %d (kept when the veth came up), then 0 again, the veth in every one", got, master)
	}
}
