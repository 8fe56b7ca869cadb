// SPDX-License-Identifier: Apache-2.0

package reconcile

import "github.com/penaltybox/penaltybox/pkg/maps"

// SetSYNGuard writes the SYN guard (pb_syn_guard): on for g.Lease from
// now, or off when g.Lease is 0. The agent decides when; the datapath
// applies it to every SYN that opens a flow.
func (r *Reconciler) SetSYNGuard(g maps.SYNGuard) error {
	return r.w.SetSYNGuard(g)
}
