// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"fmt"
	"time"

	"github.com/penaltybox/penaltybox/pkg/maps"
)

// SetInterfaces makes pb_ifaces describe exactly ifs: the interfaces
// (veths) whose packets may arrive with their L4 checksum left to the
// device, which the datapath must finish before rewriting them, and each
// interface's master, the reverse-path check's other acceptable interface.
func (r *Reconciler) SetInterfaces(ifs []maps.Iface) error {
	if err := r.w.SetIfaces(ifs); err != nil {
		return fmt.Errorf("pb_ifaces: %w", err)
	}
	return nil
}

// SetRedirectInterfaces makes pb_redirect hold exactly ifindexes, the
// egress interfaces that take XDP_REDIRECT, and turns redirecting on in
// pb_config_v2 when there is any (otherwise packets go through the stack
// after NAT, XDP_PASS).
func (r *Reconciler) SetRedirectInterfaces(ifindexes []uint32) error {
	if err := r.w.SetRedirect(ifindexes); err != nil {
		return fmt.Errorf("pb_redirect: %w", err)
	}
	c := r.config
	c.Redirect = len(ifindexes) > 0
	return r.writeConfig(c)
}

// SetDatapathConfig writes the datapath's settings but redirecting, which
// follows the interfaces (SetRedirectInterfaces).
func (r *Reconciler) SetDatapathConfig(c maps.Config) error {
	c.Redirect = r.config.Redirect
	return r.writeConfig(c)
}

// DatapathConfig is the datapath's settings as last written.
func (r *Reconciler) DatapathConfig() maps.Config { return r.config }

func (r *Reconciler) writeConfig(c maps.Config) error {
	if err := r.w.SetConfig(c); err != nil {
		return err
	}
	r.config = c
	return nil
}

// Heartbeat writes the agent's heartbeat (CLOCK_MONOTONIC nanoseconds):
// while it is fresher than the dead-man's bound, the datapath takes new
// flows.
func (r *Reconciler) Heartbeat(monotonic uint64) error {
	c := r.config
	c.Heartbeat = monotonic
	return r.writeConfig(c)
}

// EndTakeovers lets the services whose takeover grace is over take every
// flow they have no entry for (maps.ServiceTakenOver cleared). It returns
// the services it rewrote.
func (r *Reconciler) EndTakeovers() []*Service {
	var done []*Service
	for _, s := range r.services {
		if s.takenOver.IsZero() || r.clk.Since(s.takenOver) < r.takeover {
			continue
		}
		// Written without the flag now that the grace is over; kept
		// until the write succeeds, to be tried again at the next look.
		if s.value.Id != 0 {
			if err := r.writeService(s, s.value.Table, s.value.TableSize); err != nil {
				r.log.Warn("ending a service's takeover grace", "service", s.Spec.Name, "err", err)
				continue
			}
			done = append(done, s)
		}
		s.takenOver = time.Time{}
	}
	return done
}
