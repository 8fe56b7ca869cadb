// SPDX-License-Identifier: Apache-2.0

package clientlog

import (
	"testing"
	"time"
)

func TestParse(t *testing.T) {
	log := `{"t":"2026-12-01T10:00:01Z","ok":48,"refused":1,"reset":0,"timeout":1,"other":0,"skipped":0,"backends":{"a":30,"b":18}}
client: a line on stderr that kubectl logs mixes in
{"t":"2026-12-01T10:00:02Z","ok":50,"refused":0,"reset":0,"timeout":0,"other":0,"skipped":0,"backends":{}}
{"not":"a second"}
`
	secs := Parse(log)
	if len(secs) != 2 {
		t.Fatalf("%d seconds, want 2: %+v", len(secs), secs)
	}
	if s := secs[0]; s.OK != 48 || s.Failed() != 2 || s.Backends["a"] != 30 || s.T.Second() != 1 {
		t.Errorf("first second: %+v, failed %d", s, s.Failed())
	}
	if s := secs[1]; s.OK != 50 || s.Failed() != 0 {
		t.Errorf("second second: %+v", s)
	}
}

func TestTotal(t *testing.T) {
	secs := Parse(`{"t":"2026-12-01T10:00:01Z","ok":48,"refused":1,"timeout":1,"backends":{"a":30,"b":18}}
{"t":"2026-12-01T10:00:02Z","ok":50,"reset":2,"backends":{"a":50}}
{"t":"2026-12-01T10:00:03Z","ok":50,"backends":{"b":50}}`)
	from, to := secs[0].T, secs[1].T
	got := Total(secs, from, to) // (10:00:01, 10:00:02]: the second line only
	if got.OK != 50 || got.Reset != 2 || got.Failed() != 2 || got.Backends["a"] != 50 || got.Backends["b"] != 0 {
		t.Errorf("Total: %+v", got)
	}
	all := Total(secs, from.Add(-time.Second), secs[2].T)
	if all.OK != 148 || all.Failed() != 4 || all.Backends["a"] != 80 || all.Backends["b"] != 68 {
		t.Errorf("Total of all: %+v", all)
	}
}
