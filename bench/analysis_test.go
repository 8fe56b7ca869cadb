// SPDX-License-Identifier: Apache-2.0

package main

import (
	"strings"
	"testing"
)

// Each rewrite for a run without replays must still find its sentence:
// an explanation edited without it would otherwise claim replays again.
func TestReplaysOffFixesFindTheirSentences(t *testing.T) {
	for _, f := range replaysOffFixes {
		found := false
		for _, e := range explanations {
			// The texts are formats; a %% is a % once rendered.
			if strings.Contains(strings.ReplaceAll(e.text, "%%", "%"), f.was) {
				found = true
			}
		}
		if !found {
			t.Errorf("no explanation says %q", f.was)
		}
	}
}
