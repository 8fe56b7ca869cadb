// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"context"
	"net/netip"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/penaltybox/penaltybox/pkg/accrual"
)

// window gives t what a window rule saw: 3 failures and 6 slow of 10,
// against 0.2.
func window(t Transition, cause accrual.Reason) Transition {
	t.Window = accrual.WindowSnapshot{Calls: 10, Failures: 3, Slow: 6, FailureRate: 0.3, SlowRate: 0.6}
	t.Threshold, t.Cause = 0.2, cause
	return t
}

func TestPercent(t *testing.T) {
	sr := 0.93 // at run time, 1 − 0.93 is 0.06999999999999995
	for _, c := range []struct {
		in   float64
		want string
	}{{0.07, "7%"}, {0.29, "29%"}, {0.2, "20%"}, {1 - sr, "7%"}, {0.125, "12.5%"}} {
		if got, in, want := percent(c.in), c.in, c.want; got != want {
			t.Errorf("percent(%v) = %q, want %q", in, got, want)
		}
	}
}

func TestDescribe(t *testing.T) {
	addr := netip.MustParseAddrPort("198.18.3.2:8080")
	tr := func(from, to accrual.State, r accrual.Reason) Transition {
		return Transition{Service: "shop/web:http", Endpoint: "shop/web-c", Addr: addr, Transition: accrual.Transition{
			From: from, To: to, Reason: r, Kind: accrual.KindTimeout, Failures: 5, Penalty: 1234 * time.Millisecond}}
	}
	tests := []struct {
		t            Transition
		typ, reason  string
		msg          []string
		none         bool
		notInMessage string
	}{
		{t: tr(accrual.Ready, accrual.Ejected, accrual.ReasonConsecutiveFailures), typ: "Warning", reason: ReasonEndpointEjected,
			msg: []string{"pod shop/web-c (198.18.3.2:8080)", "port http", "node n1", "5 consecutive failures (last: timeout)"}, notInMessage: "1.234s"},
		{t: tr(accrual.Probation, accrual.Ejected, accrual.ReasonProbeFailed), typ: "Warning", reason: ReasonEndpointEjected,
			msg: []string{"again: its probe connection failed (timeout)"}},
		{t: window(tr(accrual.Ready, accrual.Ejected, accrual.ReasonFailureRate), ""), typ: "Warning", reason: ReasonEndpointEjected,
			msg: []string{"failure rate: more than 20% of its recent connections failed"}, notInMessage: "3 of"},
		{t: window(tr(accrual.Ready, accrual.Ejected, accrual.ReasonSlowConnects), ""), typ: "Warning", reason: ReasonEndpointEjected,
			msg: []string{"slow connects: more than 20% of its recent handshakes were slow"}, notInMessage: "60"},
		{t: window(tr(accrual.Ready, accrual.Ejected, accrual.ReasonOutlier), ""), typ: "Warning", reason: ReasonEndpointEjected,
			msg: []string{"outlier: its recent success rate was far below its peers'"}},
		{t: window(tr(accrual.Ready, accrual.Ejected, accrual.ReasonFleet), ""), typ: "Warning", reason: ReasonEndpointEjected,
			msg: []string{"on the fleet's evidence: more than 20% of its recent connections from all nodes failed"}, notInMessage: "3 of"},
		{t: window(tr(accrual.Ready, accrual.Ready, accrual.ReasonEjectionSuppressed), accrual.ReasonFailureRate), typ: "Warning", reason: ReasonEjectionSuppressed,
			msg: []string{"due to be ejected", "failure rate: more than 20%", "max-ejection-percent"}},
		{t: tr(accrual.Probation, accrual.Ready, accrual.ReasonProbeSucceeded), typ: "Normal", reason: ReasonEndpointRestored,
			msg: []string{"pod shop/web-c", "probe connection succeeded"}},
		{t: tr(accrual.Ejected, accrual.Ready, accrual.ReasonFailOpenSuccess), typ: "Normal", reason: ReasonEndpointRestored,
			msg: []string{"failed open"}},
		{t: tr(accrual.Ejected, accrual.Ready, accrual.ReasonAccrualDisabled), typ: "Normal", reason: ReasonEndpointRestored,
			msg: []string{"failure accrual was turned off"}},
		{t: tr(accrual.Ready, accrual.Ready, accrual.ReasonEjectionSuppressed), typ: "Warning", reason: ReasonEjectionSuppressed,
			msg: []string{"max-ejection-percent"}},
		{t: tr(0, 0, accrual.ReasonFailOpenStart), typ: "Warning", reason: ReasonFailingOpen, msg: []string{"port http", "all endpoints"}},
		{t: tr(0, 0, accrual.ReasonFailOpenEnd), typ: "Normal", reason: ReasonFailOpenEnded},
		{t: tr(accrual.Ejected, accrual.Probation, accrual.ReasonPenaltyOver), none: true},
		{t: tr(accrual.Probation, accrual.Probation, accrual.ReasonProbeInconclusive), none: true},
		{t: tr(accrual.Ready, accrual.Ejected, accrual.ReasonRestored), none: true},
	}
	for _, tt := range tests {
		t.Run(string(tt.t.Reason), func(t *testing.T) {
			typ, reason, msg, ok := describe(tt.t, "n1")
			if ok == tt.none {
				t.Fatalf("ok = %v", ok)
			}
			if tt.none {
				return
			}
			if typ != tt.typ || reason != tt.reason {
				t.Errorf("%s %s, want %s %s", typ, reason, tt.typ, tt.reason)
			}
			for _, w := range tt.msg {
				if !strings.Contains(msg, w) {
					t.Errorf("message %q does not contain %q", msg, w)
				}
			}
			if tt.notInMessage != "" && strings.Contains(msg, tt.notInMessage) {
				t.Errorf("message %q contains %q: repeated ejections would not fold into one Event", msg, tt.notInMessage)
			}
		})
	}
	// Without a pod the address stands alone.
	_, _, msg, _ := describe(Transition{Service: "shop/web:80", Addr: addr, Transition: accrual.Transition{
		From: accrual.Ready, To: accrual.Ejected, Reason: accrual.ReasonConsecutiveFailures}}, "n1")
	if !strings.Contains(msg, "Endpoint 198.18.3.2:8080 ejected from port 80") {
		t.Errorf("message %q", msg)
	}
}

// The real recorder writes core/v1 Events that `kubectl describe svc`
// finds: on the Service (with its UID), from this node, folding repeats.
func TestRecorderWritesEvents(t *testing.T) {
	client := fake.NewClientset()
	svc := service()
	if _, err := client.CoreV1().Services("shop").Create(context.Background(), svc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	rec, stop := NewRecorder(client, "n1")
	defer stop()
	rec.Event(svc, corev1.EventTypeWarning, ReasonEndpointEjected, "Endpoint x ejected")
	var evs []corev1.Event
	deadline := time.Now().Add(5 * time.Second)
	for len(evs) == 0 && time.Now().Before(deadline) {
		l, err := client.CoreV1().Events("shop").List(context.Background(), metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		evs = l.Items
		time.Sleep(20 * time.Millisecond)
	}
	if len(evs) != 1 {
		t.Fatalf("%d Events, want 1", len(evs))
	}
	e := evs[0]
	if e.InvolvedObject.Kind != "Service" || e.InvolvedObject.Name != "web" || e.InvolvedObject.UID != svc.UID ||
		e.Source.Component != EventComponent || e.Source.Host != "n1" || e.Type != "Warning" || e.Reason != ReasonEndpointEjected {
		t.Errorf("event %+v", e)
	}
}
