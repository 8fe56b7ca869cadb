// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"runtime"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/penaltybox/penaltybox/internal/version"
)

// One penaltybox_build_info series, 1, labelled with what internal/version
// holds (unstamped in a test binary: the -X flags are the release build's).
func TestBuildInfo(t *testing.T) {
	m := New(nil, nil, nil)
	want := `# HELP penaltybox_build_info 1, labelled with the agent's version, git revision and Go version.
# TYPE penaltybox_build_info gauge
penaltybox_build_info{goversion="` + runtime.Version() + `",revision="` + version.Revision() + `",version="` + version.Version() + `"} 1
`
	if err := testutil.GatherAndCompare(m.Registry, strings.NewReader(want), "penaltybox_build_info"); err != nil {
		t.Fatal(err)
	}
}
