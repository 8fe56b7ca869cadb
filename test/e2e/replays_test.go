// SPDX-License-Identifier: Apache-2.0

package e2e

import (
	"errors"
	"sync"
	"testing"

	"github.com/penaltybox/penaltybox/pkg/replay"
)

// liveFrames is replay.Probe's answer on this kernel, asked once.
var liveFrames = sync.OnceValue(replay.Probe)

// replaysWork says whether this kernel lets the agent send SYN replays.
// Where it refuses (some hardened kernels refuse BPF_PROG_RUN's
// live-frame mode even to root), the agent replays nothing, and the tests
// that expect replays check what holds without them: no client failure
// when clients wait long enough for their own retransmission.
func replaysWork(t *testing.T) bool {
	t.Helper()
	switch err := liveFrames(); {
	case errors.Is(err, replay.ErrLiveFramesRefused):
		t.Logf("this kernel refuses SYN replays (the agent sends none): %v", err)
		return false
	case err != nil:
		t.Fatal(err)
	}
	return true
}
