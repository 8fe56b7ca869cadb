// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"sync"
	"testing"

	"github.com/penaltybox/penaltybox/pkg/replay"
)

// liveFrames is replay.Probe's answer on this kernel, asked once.
var liveFrames = sync.OnceValue(replay.Probe)

// replaysWork says whether this kernel lets the agent send SYN replays.
// Where it refuses (some hardened kernels refuse BPF_PROG_RUN's
// live-frame mode even to root), the tests that expect replays check
// their fallback instead: no client failure, each client waiting for its
// own retransmission, and each attempt counted as a replay error.
func replaysWork(t *testing.T) bool {
	t.Helper()
	if err := liveFrames(); err != nil {
		t.Logf("this kernel refuses SYN replays, so their fallback is checked instead: %v", err)
		return false
	}
	return true
}
