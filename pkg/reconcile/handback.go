// SPDX-License-Identifier: Apache-2.0

package reconcile

import (
	"fmt"
	"slices"
	"time"

	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/maps"
)

// handBack is a removed service whose pb_services entry stays, flagged
// maps.ServiceHandedBack: its new flows pass to kube-proxy while the flows
// the datapath admitted finish, and the datapath clears the kernel's
// conntrack of those flows' entries on the tuples of kube-proxy's new
// ones (the kernel keeps them minutes after the flows end, and they would
// capture a new connection from the same client port: see nf_forget in
// bpf/lb.c). The entry goes once no flow has lived for Options.HandBack.
type handBack struct {
	key desired.Key
	svc *Service
	// lastLive: when a flow of the service was last seen alive (Sweep),
	// or when it was handed back.
	lastLive time.Time
}

// handBackOrDelete takes removed service s (key) out of the datapath's
// hands: when it is to be handed back (it still exists, kube-proxy's now),
// flagged and kept while its flows may linger in the kernel's conntrack;
// deleted when it is gone, when there is nothing to hand back (no entry
// written, no HandBack time) or flagging it failed. A deleted service's
// flows finish all the same (conntrack needs no service).
func (r *Reconciler) handBackOrDelete(key desired.Key, s *Service, now time.Time, back bool) error {
	if back && r.handBackFor > 0 && s.value.Id != 0 {
		// No live table: it picks for no new flow, and holds backends
		// that are retired now and cleared once their flows end.
		v := s.value
		v.Flags = (v.Flags | maps.ServiceHandedBack) &^ maps.ServiceTakenOver
		v.TableSize = 0
		err := r.w.UpsertService(maps.ServiceKey(key.VIP, key.Port, uint8(key.Protocol)), v)
		if err == nil {
			s.value = v
			s.takenOver = time.Time{}
			r.handingBack[s.ID] = &handBack{key: key, svc: s, lastLive: now}
			return nil
		}
		r.log.Warn("handing a removed service back to kube-proxy; deleting it instead", "service", s.Spec.Name, "err", err)
	}
	if err := r.w.DeleteService(maps.ServiceKey(key.VIP, key.Port, uint8(key.Protocol)), s.ID); err != nil {
		// Retried by every later Apply and PrepareTables; until then the
		// id stays out of reuse.
		r.deleting[s.ID] = key
		return err
	}
	r.retiredSvc[s.ID] = r.retiredAt(now)
	return nil
}

// takeBack returns the service handed back under key, served again: it
// keeps its id and entry (rewritten by the caller without the flag), and
// is taken over anew, since kube-proxy had its new flows meanwhile. Nil
// when none is handed back under key.
func (r *Reconciler) takeBack(key desired.Key, now time.Time) *Service {
	for id, hb := range r.handingBack {
		if hb.key != key {
			continue
		}
		delete(r.handingBack, id)
		delete(r.retiredKey, id)
		s := hb.svc
		if r.takeover > 0 {
			s.takenOver = now
		}
		r.services[key] = s
		r.byID[id] = s
		r.log.Info("service taken back from kube-proxy", "service", key.String(), "id", id)
		return s
	}
	return nil
}

// endHandBacks deletes the entries of services handed back whose flows
// have all been gone for HandBack (live flows per inUse); their ids then
// cool down like any removed service's.
func (r *Reconciler) endHandBacks(inUse InUse, now time.Time) {
	for id, hb := range r.handingBack {
		if inUse.Services[id] {
			hb.lastLive = now
			continue
		}
		if now.Sub(hb.lastLive) < r.handBackFor {
			continue
		}
		r.endHandBack(id, hb, now)
	}
}

// endGoneHandBacks deletes the entries of services handed back that are
// gone now (no longer in the desired state's HandBack: the Service was
// deleted).
func (r *Reconciler) endGoneHandBacks(back []desired.Key, now time.Time) {
	for id, hb := range r.handingBack {
		if !slices.Contains(back, hb.key) {
			r.endHandBack(id, hb, now)
		}
	}
}

// endHandBack deletes the entry of service id, handed back; its id then
// cools down like any removed service's. On error it stays handed back
// and is tried again later.
func (r *Reconciler) endHandBack(id uint32, hb *handBack, now time.Time) {
	if err := r.w.DeleteService(maps.ServiceKey(hb.key.VIP, hb.key.Port, uint8(hb.key.Protocol)), id); err != nil {
		r.log.Warn("deleting a service handed back", "service", hb.key.String(), "err", err)
		return
	}
	delete(r.handingBack, id)
	r.retiredSvc[id] = r.retiredAt(now)
	r.retiredKey[id] = hb.key
}

// HandingBack is how many removed services are still handed back.
func (r *Reconciler) HandingBack() int { return len(r.handingBack) }

// TakeOverAll marks every service taken over anew, as if first served now:
// kube-proxy had their new flows for a while (the datapath's dead-man's
// switch tripped while no agent ran), so its flows are alive or linger in
// the kernel's conntrack.
func (r *Reconciler) TakeOverAll() error {
	if r.takeover == 0 {
		return nil
	}
	now := r.clk.Now()
	var first error
	for key, s := range r.services {
		s.takenOver = now
		if s.value.Id == 0 || s.value.Flags&maps.ServiceTakenOver != 0 {
			continue
		}
		// The flag alone: an adopted service's spec is not known before
		// the first Apply, which writes the rest.
		v := s.value
		v.Flags |= maps.ServiceTakenOver
		if err := r.w.UpsertService(maps.ServiceKey(key.VIP, key.Port, uint8(key.Protocol)), v); err != nil {
			if first == nil {
				first = fmt.Errorf("service %s: %w", key, err)
			}
			continue
		}
		s.value = v
	}
	return first
}
