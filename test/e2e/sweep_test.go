// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/penaltybox/penaltybox/bpf"
	"github.com/penaltybox/penaltybox/internal/testnet"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// The conntrack sweep ends the flows the datapath leaves behind: 40
// connections, each reset by its client (a close the datapath does not see
// complete, unlike a FIN each way: see
// TestClosedFlowsLeaveConntrackAtTheirClose), are expired once the closed
// timeout (10 s) has passed, by the kernel's sweep (pb_ct_sweep_run, the default) and by
// the agent's copy of the table (--kernel-sweep=false), which the agent
// says it uses and conntrack_sweeps_total counts. conntrack_size is the
// table's size (--conntrack-size), which PenaltyboxConntrackFull holds
// conntrack_entries against.
func TestConntrackSweepExpiresClosedFlows(t *testing.T) {
	for _, kernel := range []bool{true, false} {
		name := "kernel"
		if !kernel {
			name = "copy"
		}
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, 2)
			a := e.startAgent(config(e.topo, all(2), ""), "--kernel-sweep="+strconv.FormatBool(kernel), "--conntrack-size=131072")
			rs, err := testnet.Load(e.ctx, e.topo.Client, testnet.LoadSpec{Target: testnet.VIP + ":80",
				Rate: 200, Count: 40, ConnectTimeout: 3 * time.Second, RequestTimeout: 3 * time.Second, Abort: true})
			if err != nil {
				t.Fatal(err)
			}
			if ok := rs.Count(testnet.OK); ok != 40 {
				t.Fatalf("%d of 40 connections succeeded: %v", ok, rs)
			}
			// Closed 10 s ago at the sweep after that: two sweeps (10 s
			// apart) at most, and a margin for a loaded machine.
			eventually(t, 40*time.Second, "40 flows expired", func() bool {
				return e.metrics().Get("penaltybox_conntrack_expired_flows_total") >= 40
			})
			m := e.metrics()
			if got := m.Get("penaltybox_conntrack_expired_flows_total"); got != 40 {
				t.Errorf("expired %v flows, want 40", got)
			}
			if got := m.Get("penaltybox_conntrack_size"); got != 131072 {
				t.Errorf("conntrack_size %v, want --conntrack-size's 131072", got)
			}
			sweeps := map[string]float64{}
			for _, way := range []string{"kernel", "copy", "fallback"} {
				sweeps[way] = m.Get("penaltybox_conntrack_sweeps_total", "way", way)
			}
			if sweeps[name] < 1 || sweeps["kernel"]+sweeps["copy"]+sweeps["fallback"] != sweeps[name] {
				t.Errorf("sweeps by way %v; want only %s", sweeps, name)
			}
			b, err := os.ReadFile(a.LogPath())
			if err != nil {
				t.Fatal(err)
			}
			copied := strings.Contains(string(b), "sweeps a copy of the conntrack table (--kernel-sweep=false)")
			if copied == kernel {
				t.Errorf("the agent says it copies the table: %v; want %v", copied, !kernel)
			}
			if strings.Contains(string(b), "kernel conntrack sweep") {
				t.Errorf("the kernel's sweep was refused or failed:\n%s", a.LogTail(40))
			}
		})
	}
}

// A connection closed with a FIN each way, the second acknowledging the
// first, leaves conntrack at its last ACK (the datapath's fin_seen), not
// at a sweep 10 s or more after (which could not expire a flow closed a
// moment ago). Both orders, 20 connections each, so that no close is
// simultaneous (each FIN crossing the other: those stay for the sweep):
// clients that connect and close, whose backend closes once it has read
// their FIN; and clients that read their response to the backend's FIN
// before they close. The table holds none of their entries moments after.
func TestClosedFlowsLeaveConntrackAtTheirClose(t *testing.T) {
	e := newEnv(t, 2)
	a := e.startAgent(config(e.topo, all(2), ""))
	ct, err := ebpf.LoadPinnedMap(filepath.Join(a.BPFFSRoot, bpf.LbMapPbCtV2), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer ct.Close()
	rs, err := testnet.Load(e.ctx, e.topo.Client, testnet.LoadSpec{Target: testnet.VIP + ":80",
		Rate: 200, Count: 20, ConnectTimeout: 3 * time.Second, ConnectOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if ok := rs.Count(testnet.OK); ok != 20 {
		t.Fatalf("%d of 20 connections succeeded: %v", ok, rs)
	}
	d := e.topo.Client.Dialer(3 * time.Second)
	for i := range 20 {
		c, err := d.DialContext(e.ctx, "tcp", testnet.VIP+":80")
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		_, err = fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", testnet.VIP)
		if err == nil {
			_, err = io.ReadAll(c) // to the backend's FIN
		}
		c.Close()
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
	}
	// The last ACKs are on their way as the clients return: a margin. A
	// client's FIN sent again because the backend's last ACK came late
	// (a loaded machine) is picked up midstream after the delete, and that
	// pickup stays the closed timeout: logged, not counted.
	var left []string
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		left = left[:0]
		pickups := 0
		var k bpf.LbCtKey
		var v bpf.LbCtValue
		it := ct.Iterate()
		for it.Next(&k, &v) {
			if v.Flags&maps.CTMidstream != 0 {
				pickups++
				continue
			}
			left = append(left, fmt.Sprintf("{dir %d, ports %d -> %d, flags %#x}", k.Dir, k.Sport, k.Dport, v.Flags))
		}
		if pickups > 0 && len(left) == 0 {
			t.Logf("%d entries of FINs picked up after their flow's delete", pickups)
		}
		if err := it.Err(); err != nil {
			t.Fatal(err)
		}
		if len(left) == 0 || time.Now().After(deadline) {
			break
		}
	}
	if len(left) > 0 {
		t.Errorf("%d conntrack entries left 5 s after the last close: %v", len(left), left)
	}
}
