// SPDX-License-Identifier: Apache-2.0

package config

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/penaltybox/penaltybox/pkg/accrual"
)

func TestResolveFailureAccrual(t *testing.T) {
	base := accrual.Defaults()
	s, err := ResolveFailureAccrual("spec.failureAccrual", []byte(`{"mode":"failure-rate","minPenalty":"5s","failureKinds":["refused"],"jitterRatio":0}`), base)
	if err != nil {
		t.Fatal(err)
	}
	if s.Mode != accrual.ModeFailureRate || s.MinPenalty != 5*time.Second || s.FailureKinds != accrual.KindsOf(accrual.KindRefused) || s.JitterRatio != 0 {
		t.Errorf("got %+v", s)
	}
	if s.MaxPenalty != base.MaxPenalty || s.MaxFailures != base.MaxFailures {
		t.Errorf("fields the block does not set changed: %+v", s)
	}
	for _, empty := range []string{"", "null", " "} {
		if s, err := ResolveFailureAccrual("p", []byte(empty), base); err != nil || s != base {
			t.Errorf("%q: %+v, %v; want base", empty, s, err)
		}
	}
	for _, c := range []struct{ block, path, value string }{
		{`{"minPenalty":"2m"}`, "spec.failureAccrual.minPenalty", `"2m"`}, // above the inherited maxPenalty
		{`{"maxFailures":"7"}`, "spec.failureAccrual.maxFailures", `"7"`}, // wrong type
		{`{"maxFailure":7}`, "spec.failureAccrual.maxFailure", ``},        // unknown field
		{`{"failureKinds":["refused","nope"]}`, "spec.failureAccrual.failureKinds[1]", `"nope"`},
		{`{"jitterRatio":2}`, "spec.failureAccrual.jitterRatio", `2`},
	} {
		got, err := ResolveFailureAccrual("spec.failureAccrual", []byte(c.block), base)
		var fe *FieldError
		if !errors.As(err, &fe) {
			t.Errorf("%s: err %v, want a FieldError", c.block, err)
			continue
		}
		if fe.Path != c.path || fe.Value != c.value {
			t.Errorf("%s: error at %s = %s (%v), want %s = %s", c.block, fe.Path, fe.Value, err, c.path, c.value)
		}
		if got != base {
			t.Errorf("%s: settings changed on error", c.block)
		}
		if !strings.HasPrefix(err.Error(), c.path) {
			t.Errorf("%s: %q does not start with the path", c.block, err)
		}
	}
}
