// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"fmt"
	"slices"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// ServiceCounters are counters that every service has from the moment it
// is programmed, at 0, so that rate() over them is 0 rather than absent
// and increase() sees their first increment (Prometheus does not count a
// series' first sample as an increase). Each service has one series per
// value of at most one more label, a fixed set.
//
// A CounterVec child costs about 750 bytes (its label pairs, the counter,
// the vector's entry): kernel_trips_total's two series and
// new_flows_to_ejected_total's one took 23 MB of the agent's heap at
// 10,000 services. Here a service costs its map entry and a word per
// series, and the series are made at scrape time, as the collector's
// per-service ones are.
type ServiceCounters struct {
	desc   *prometheus.Desc
	values []string // the extra label's values; nil: no extra label

	mu   sync.Mutex
	svcs map[string][]uint64 // service name: a count per value
}

// NewServiceCounters is a counter of the service's labels and, when label
// is not empty, label with exactly values.
func NewServiceCounters(opts prometheus.CounterOpts, label string, values ...string) *ServiceCounters {
	labels := slices.Clone(svcLabels)
	if label != "" {
		if len(values) == 0 {
			panic(fmt.Sprintf("metrics: %s: label %s without values", opts.Name, label))
		}
		labels = append(labels, label)
	} else {
		values = nil
	}
	name := prometheus.BuildFQName(opts.Namespace, opts.Subsystem, opts.Name)
	return &ServiceCounters{
		desc:   prometheus.NewDesc(name, opts.Help, labels, opts.ConstLabels),
		values: slices.Clone(values),
		svcs:   map[string][]uint64{},
	}
}

// counts returns service's counts, adding it at 0. Called with mu held.
func (v *ServiceCounters) counts(service string) []uint64 {
	c, ok := v.svcs[service]
	if !ok {
		c = make([]uint64, max(len(v.values), 1))
		v.svcs[service] = c
	}
	return c
}

// index is value's position; it panics on a value not declared, as a
// CounterVec does on a wrong number of labels: a programming error.
func (v *ServiceCounters) index(value []string) int {
	if len(v.values) == 0 {
		if len(value) != 0 {
			panic(fmt.Sprintf("metrics: %s takes no label besides the service's, got %q", v.desc, value))
		}
		return 0
	}
	if len(value) == 1 {
		if i := slices.Index(v.values, value[0]); i >= 0 {
			return i
		}
	}
	panic(fmt.Sprintf("metrics: %s: label value %q is none of %q", v.desc, value, v.values))
}

// Add makes service's series exist, at 0 where they are new.
func (v *ServiceCounters) Add(service string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.counts(service)
}

// Inc counts one for service (and the extra label's value, when the
// counter has one), adding the service if it was not there.
func (v *ServiceCounters) Inc(service string, value ...string) {
	i := v.index(value)
	v.mu.Lock()
	defer v.mu.Unlock()
	v.counts(service)[i]++
}

// Get is the count of service (and value); 0 for a service not added.
func (v *ServiceCounters) Get(service string, value ...string) float64 {
	i := v.index(value)
	v.mu.Lock()
	defer v.mu.Unlock()
	if c, ok := v.svcs[service]; ok {
		return float64(c[i])
	}
	return 0
}

// Len is how many services have series.
func (v *ServiceCounters) Len() int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return len(v.svcs)
}

// Describe implements prometheus.Collector.
func (v *ServiceCounters) Describe(ch chan<- *prometheus.Desc) { ch <- v.desc }

// Collect implements prometheus.Collector.
func (v *ServiceCounters) Collect(ch chan<- prometheus.Metric) {
	type series struct {
		labels []string
		n      uint64
	}
	v.mu.Lock()
	out := make([]series, 0, len(v.svcs)*max(len(v.values), 1))
	for svc, c := range v.svcs {
		ns, name, port := SplitService(svc)
		if len(v.values) == 0 {
			out = append(out, series{[]string{ns, name, port}, c[0]})
			continue
		}
		for i, val := range v.values {
			out = append(out, series{[]string{ns, name, port, val}, c[i]})
		}
	}
	v.mu.Unlock()
	// Sent without the lock: the registry may be slow to take them.
	for _, s := range out {
		counter(ch, v.desc, s.n, s.labels...)
	}
}
