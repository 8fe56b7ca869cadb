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
// timeouts, twice in CI).
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
				if len(got) == 1 {
					// The first update is the state listed at start.
					if err := h.LinkSetMaster(vethLink, brLink); err != nil {
						t.Error(err)
						return
					}
				}
				if u.Links[i].Master == master {
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
	if len(got) == 0 || got[0] != 0 || got[len(got)-1] != master {
		t.Errorf("the veth's master in the updates: %v; want 0 first, then the bridge's ifindex %d", got, master)
	}
}
