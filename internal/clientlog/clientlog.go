// Package clientlog is the output of the cluster test's client
// (test/cluster/images/client): one JSON line per second, written by the
// client and read by the test and the demo.
package clientlog

import (
	"encoding/json"
	"strings"
	"time"
)

// StreamEnd is the test server's last line of a whole stream: a client
// that reads to EOF without it was cut.
const StreamEnd = "end\n"

// Second is one line of the test client's output (test/cluster/images/client):
// the connections that ended in that second, by outcome, and which backend
// pod answered the successful ones.
type Second struct {
	T        time.Time      `json:"t"`
	OK       int            `json:"ok"`
	Refused  int            `json:"refused"`
	Reset    int            `json:"reset"`
	Timeout  int            `json:"timeout"`
	Other    int            `json:"other"`
	Skipped  int            `json:"skipped"`
	Backends map[string]int `json:"backends"`
	// Streams that ended in the second: whole (the server's clean close
	// after its full length) or cut (an error before it).
	StreamsOK  int `json:"streams_ok,omitempty"`
	StreamsCut int `json:"streams_cut,omitempty"`
}

// Failed is the number of connections that did not succeed.
func (s Second) Failed() int { return s.Refused + s.Reset + s.Timeout + s.Other + s.Skipped }

// Parse reads the client's log, skipping lines that are not its JSON.
func Parse(log string) []Second {
	var out []Second
	for _, line := range strings.Split(log, "\n") {
		var s Second
		if json.Unmarshal([]byte(line), &s) == nil && !s.T.IsZero() {
			out = append(out, s)
		}
	}
	return out
}

// Add counts o's connections into s.
func (s *Second) Add(o Second) {
	s.OK += o.OK
	s.Refused += o.Refused
	s.Reset += o.Reset
	s.Timeout += o.Timeout
	s.Other += o.Other
	s.Skipped += o.Skipped
	s.StreamsOK += o.StreamsOK
	s.StreamsCut += o.StreamsCut
	if s.Backends == nil {
		s.Backends = map[string]int{}
	}
	for b, n := range o.Backends {
		s.Backends[b] += n
	}
}

// Total adds up the seconds that end in (from, to].
func Total(secs []Second, from, to time.Time) Second {
	total := Second{Backends: map[string]int{}}
	for _, s := range secs {
		if s.T.After(from) && !s.T.After(to) {
			total.Add(s)
		}
	}
	return total
}
