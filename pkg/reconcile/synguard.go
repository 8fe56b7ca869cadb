package reconcile

import "time"

// GuardSYNs writes the SYN guard (pb_syn_guard) with its budget and trust
// (Options.SYNGuard): on for lease from now, renewing it, or off with
// lease 0. The agent decides when (flood mode); the datapath applies it to
// every SYN that opens a flow.
func (r *Reconciler) GuardSYNs(lease time.Duration) error {
	g := r.guard
	g.Lease = lease
	return r.w.SetSYNGuard(g)
}
