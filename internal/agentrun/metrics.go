// SPDX-License-Identifier: Apache-2.0

package agentrun

import (
	"fmt"
	"slices"
	"strings"

	dto "github.com/prometheus/client_model/go"
)

// Metrics is one scrape, by family name.
type Metrics map[string]*dto.MetricFamily

// Value returns the value of the series of family name whose labels
// include every given pair ("k", "v", ...), summed over matching series.
// ok is false when no series matches.
func (m Metrics) Value(name string, labels ...string) (v float64, ok bool) {
	fam, found := m[name]
	if !found {
		return 0, false
	}
	for _, s := range fam.Metric {
		if !matches(s, labels) {
			continue
		}
		ok = true
		if x, scalar := scalarValue(s); scalar {
			v += x
		} else if s.Histogram != nil {
			v += float64(s.Histogram.GetSampleCount())
		}
	}
	return v, ok
}

// Get is Value without ok (0 when absent).
func (m Metrics) Get(name string, labels ...string) float64 {
	v, _ := m.Value(name, labels...)
	return v
}

// scalarValue is a counter's, gauge's or untyped series' value; ok is
// false for the other types.
func scalarValue(s *dto.Metric) (v float64, ok bool) {
	switch {
	case s.Counter != nil:
		return s.Counter.GetValue(), true
	case s.Gauge != nil:
		return s.Gauge.GetValue(), true
	case s.Untyped != nil:
		return s.Untyped.GetValue(), true
	}
	return 0, false
}

func matches(s *dto.Metric, labels []string) bool {
	for i := 0; i+1 < len(labels); i += 2 {
		found := false
		for _, l := range s.Label {
			if l.GetName() == labels[i] && l.GetValue() == labels[i+1] {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// NonZero lists the series of the families whose name starts with prefix
// and whose value is not 0, as "name{k=v,...} value": what a test prints
// when a packet went missing, to say where the datapath put it.
func (m Metrics) NonZero(prefix string) []string {
	var out []string
	for name, fam := range m {
		if !strings.HasPrefix(name, prefix) {
			continue
		}
		for _, s := range fam.Metric {
			v, scalar := scalarValue(s)
			if !scalar || v == 0 {
				continue
			}
			labels := make([]string, 0, len(s.Label))
			for _, l := range s.Label {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			out = append(out, fmt.Sprintf("%s{%s} %g", name, strings.Join(labels, ","), v))
		}
	}
	slices.Sort(out)
	return out
}
