// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"context"
	"fmt"
	"math"
	"net/netip"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"

	"github.com/penaltybox/penaltybox/pkg/accrual"
)

// EventComponent is the source component of the agent's Events.
const EventComponent = "penaltybox"

// NewRecorder returns an Event recorder writing core/v1 Events (what
// `kubectl describe` and `kubectl get events` show) for this node, and a
// function that stops it. client-go's correlator rate-limits and folds
// them: identical Events become one with a count, similar ones are
// aggregated after 10 in 10 minutes, and each (node, Service, type,
// reason) gets a burst of 25 then one per 5 minutes — so a flapping
// endpoint or a mass ejection cannot flood the API server, and a storm of
// ejections does not silence an InvalidAnnotation warning.
func NewRecorder(client kubernetes.Interface, nodeName string) (record.EventRecorder, func()) {
	b := record.NewBroadcaster(record.WithCorrelatorOptions(record.CorrelatorOptions{SpamKeyFunc: spamKey}))
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	rec := b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: EventComponent, Host: nodeName})
	return rec, b.Shutdown
}

// spamKey is client-go's default spam key (source, object, type) plus the
// reason.
func spamKey(e *corev1.Event) string {
	return strings.Join([]string{e.Source.Component, e.Source.Host, e.InvolvedObject.Kind,
		e.InvolvedObject.Namespace, e.InvolvedObject.Name, string(e.InvolvedObject.UID),
		e.InvolvedObject.APIVersion, e.Type, e.Reason}, "\x00")
}

// Transition is an accrual decision as the agent reports it: the desired
// service's name, the endpoint's name ("namespace/pod", possibly empty)
// and address.
type Transition struct {
	Service  string
	Endpoint string
	Addr     netip.AddrPort
	accrual.Transition
}

// Notify hands a transition over for an Event on its Service. It never
// blocks (the agent calls it with its lock held, between programming the
// maps and reading the next outcome): when the Event queue is full the
// transition gets no Event; the agent's log and metrics still have it.
func (c *Controller) Notify(t Transition) {
	if _, _, _, ok := describe(t, c.opts.NodeName); !ok {
		return
	}
	select {
	case c.notes <- t:
	default:
		c.log.Warn("event queue full, no Event for this transition", "service", t.Service,
			"endpoint", t.Endpoint, "reason", string(t.Reason))
	}
}

// eventLoop turns notes into Events until ctx ends.
func (c *Controller) eventLoop(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case t := <-c.notes:
			svc, err := c.serviceOf(t.Service)
			if err != nil {
				// The Service was deleted since: nothing to attach it to.
				c.log.Debug("no Event for transition", "service", t.Service, "err", err)
				continue
			}
			typ, reason, msg, _ := describe(t, c.opts.NodeName)
			c.recorder.Event(svc, typ, reason, msg)
		}
	}
}

// describe renders the Event for a transition; ok is false for those that
// get none (penalty over, inconclusive probes, restored after a restart).
// Messages leave out what varies between occurrences (the drawn penalty),
// so a pod that keeps failing shows as one Event with a growing count.
func describe(t Transition, node string) (typ, reason, msg string, ok bool) {
	port := t.Service
	if i := strings.LastIndexByte(port, ':'); i >= 0 {
		port = port[i+1:]
	}
	who := t.Addr.String()
	if t.Endpoint != "" {
		who = "pod " + t.Endpoint + " (" + who + ")"
	}
	switch {
	case t.Reason == accrual.ReasonFailOpenStart:
		return corev1.EventTypeWarning, ReasonFailingOpen, fmt.Sprintf(
			"No endpoint of port %s is ready on node %s: new connections go to all endpoints (failing open)", port, node), true
	case t.Reason == accrual.ReasonFailOpenEnd:
		return corev1.EventTypeNormal, ReasonFailOpenEnded, fmt.Sprintf(
			"Port %s no longer fails open on node %s", port, node), true
	case t.Reason == accrual.ReasonEjectionSuppressed:
		if t.Cause != "" && t.Cause != accrual.ReasonConsecutiveFailures {
			return corev1.EventTypeWarning, ReasonEjectionSuppressed, fmt.Sprintf(
				"Endpoint %s of port %s was due to be ejected on node %s (%s) but was not: max-ejection-percent reached",
				who, port, node, windowWhy(t.Transition)), true
		}
		return corev1.EventTypeWarning, ReasonEjectionSuppressed, fmt.Sprintf(
			"Endpoint %s of port %s failed %d times in a row (%v) on node %s but was not ejected: max-ejection-percent reached",
			who, port, t.Failures, t.Kind, node), true
	case t.Reason == accrual.ReasonRestored:
		return "", "", "", false
	case t.To == accrual.Ejected && t.From != accrual.Ejected:
		why := fmt.Sprintf("after %d consecutive failures (last: %v)", t.Failures, t.Kind)
		switch t.Reason {
		case accrual.ReasonProbeFailed:
			why = fmt.Sprintf("again: its probe connection failed (%v)", t.Kind)
		case accrual.ReasonFailureRate, accrual.ReasonSlowConnects, accrual.ReasonOutlier, accrual.ReasonFleet:
			why = windowWhy(t.Transition)
		}
		return corev1.EventTypeWarning, ReasonEndpointEjected, fmt.Sprintf(
			"Endpoint %s ejected from port %s on node %s %s; new connections avoid it until a probe connection succeeds",
			who, port, node, why), true
	case t.To == accrual.Ready && t.From != accrual.Ready:
		why := string(t.Reason)
		switch t.Reason {
		case accrual.ReasonProbeSucceeded:
			why = "its probe connection succeeded"
		case accrual.ReasonFailOpenSuccess:
			why = "it answered while the port failed open"
		case accrual.ReasonAccrualDisabled:
			why = "failure accrual was turned off"
		}
		return corev1.EventTypeNormal, ReasonEndpointRestored, fmt.Sprintf(
			"Endpoint %s restored to port %s on node %s: %s", who, port, node, why), true
	}
	return "", "", "", false
}

// windowWhy names the window rule and its limit, in an Event's words.
// The window's counts vary from one ejection to the next and would split
// one Event into many; the agent's log line and /admin/endpoints have them.
func windowWhy(t accrual.Transition) string {
	r := t.Reason
	if r == accrual.ReasonEjectionSuppressed {
		r = t.Cause
	}
	switch r {
	case accrual.ReasonFailureRate:
		return "for its failure rate: more than " + percent(t.Threshold) + " of its recent connections failed"
	case accrual.ReasonSlowConnects:
		return "for slow connects: more than " + percent(t.Threshold) + " of its recent handshakes were slow"
	case accrual.ReasonOutlier:
		return "as an outlier: its recent success rate was far below its peers'"
	case accrual.ReasonFleet:
		return "on the fleet's evidence: more than " + percent(t.Threshold) + " of its recent connections from all nodes failed"
	}
	return string(r)
}

// percent renders a share as a percentage without float noise (0.07 is
// "7%", not "7.000000000000001%").
func percent(share float64) string {
	return strconv.FormatFloat(math.Round(100*share*1e6)/1e6, 'f', -1, 64) + "%"
}
