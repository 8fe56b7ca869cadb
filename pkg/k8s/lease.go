// SPDX-License-Identifier: Apache-2.0

package k8s

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

// Lease timings. Every agent that does not hold a Lease reads it once a
// retryPeriod (client-go jitters it): N nodes cost about N/30 reads a
// second, not the N/2 of client-go's usual 2s. Nothing the Leases elect is
// urgent: a holder that dies leaves the job undone for at most
// leaseDuration plus a retry.
const (
	leaseDuration = 90 * time.Second
	renewDeadline = 60 * time.Second
	retryPeriod   = 30 * time.Second
)

// leaseJob is a job one agent of the cluster does: the one holding the
// Lease Namespace/Name.
type leaseJob struct {
	Client              kubernetes.Interface
	Namespace, Name     string
	Identity            string           // this agent's name in the Lease (its node)
	Gauge               prometheus.Gauge // 1 while this agent holds it; may be nil
	Log                 *slog.Logger
	Doing, Stopped      string // log lines: started, stopped doing the job
	Elsewhere, Disabled string // another agent does it; the job cannot run here
	// Work does the job until ctx ends (the Lease lost or the agent
	// stopping).
	Work func(ctx context.Context)
}

// run competes for the Lease until ctx ends, doing the job while it holds
// it.
func (j leaseJob) run(ctx context.Context) {
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Name: j.Name, Namespace: j.Namespace},
		Client:     j.Client.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: j.Identity},
	}
	log := j.Log.With("lease", j.Namespace+"/"+j.Name)
	for ctx.Err() == nil {
		// client-go runs OnStartedLeading on a goroutine of its own and
		// returns from Run without waiting for it: the job's goroutine is
		// waited for here, so a term's job never overlaps the next one's,
		// and the gauge and the "stopped" line follow it.
		var (
			work sync.WaitGroup
			mu   sync.Mutex
			over bool // Run returned: a job starting late does not start
			held atomic.Bool
		)
		le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
			Lock:            lock,
			Name:            j.Name,
			LeaseDuration:   leaseDuration,
			RenewDeadline:   renewDeadline,
			RetryPeriod:     retryPeriod,
			ReleaseOnCancel: true,
			Callbacks: leaderelection.LeaderCallbacks{
				OnStartedLeading: func(ctx context.Context) {
					mu.Lock()
					if over {
						mu.Unlock()
						return
					}
					work.Add(1)
					mu.Unlock()
					defer work.Done()
					held.Store(true)
					log.Info(j.Doing)
					setGauge(j.Gauge, 1)
					j.Work(ctx)
				},
				OnStoppedLeading: func() {},
				OnNewLeader: func(id string) {
					if id != j.Identity {
						log.Info(j.Elsewhere, "holder", id)
					}
				},
			},
		})
		if err != nil {
			log.Error(j.Disabled, "err", err)
			return
		}
		le.Run(ctx)
		mu.Lock()
		over = true
		mu.Unlock()
		work.Wait()
		if held.Load() {
			setGauge(j.Gauge, 0)
			log.Info(j.Stopped)
		}
	}
}

func setGauge(g prometheus.Gauge, v float64) {
	if g != nil {
		g.Set(v)
	}
}
