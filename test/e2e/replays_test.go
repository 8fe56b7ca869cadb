// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/internal/agentrun"
)

// waitedForRetransmission: a connection that took this long waited for
// its client's own SYN retransmission. Linux retransmits an unanswered
// SYN after 1 s (its initial RTO), and a timer never fires early, so such
// a connection takes at least 1 s. A replayed one takes its replay
// deadline (at most half the connect timeout: 150 ms in these tests) and
// a round trip: natively well under 500 ms, but 411-457 ms at the slowest
// in the kernel matrix's emulated VMs (TestUnansweredSYNsAreReplayed, run
// there once; some of these tests run there: scripts/kernel-matrix.sh).
// 800 ms keeps a margin on both sides.
const waitedForRetransmission = 800 * time.Millisecond

// replaysOff checks what an agent says and does on a kernel that refuses
// SYN replays (bpftest.LiveFrames false): it said so at start, replays
// nothing, and shows no replay deadline.
func (e *env) replaysOff(t *testing.T, m agentrun.Metrics) {
	t.Helper()
	if b, err := os.ReadFile(e.agent.LogPath()); err != nil || !strings.Contains(string(b), "SYN replays off") {
		t.Errorf("the agent's log does not say that SYN replays are off (%v)", err)
	}
	if got := m.NonZero("penaltybox_syn_replays"); len(got) != 0 {
		t.Errorf("replays counted though the agent has none: %v", got)
	}
	var v servicesView
	if err := e.agent.JSON(e.ctx, "/admin/services", &v); err != nil {
		t.Fatal(err)
	}
	if got := v.Services[0].ReplayAfter; got != "" {
		t.Errorf("/admin/services replayAfter %q, want none", got)
	}
}
