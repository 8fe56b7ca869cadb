package reconcile

import (
	"fmt"

	"github.com/penaltybox/penaltybox/pkg/maps"
)

// SetPartialInterfaces makes pb_partial_ifaces hold exactly ifindexes: the
// interfaces (veths) whose packets may arrive with their L4 checksum left
// to the device, which the datapath must finish before rewriting them.
func (r *Reconciler) SetPartialInterfaces(ifindexes []uint32) error {
	if err := r.w.SetPartialIfaces(ifindexes); err != nil {
		return fmt.Errorf("pb_partial_ifaces: %w", err)
	}
	return nil
}

// SetRedirectInterfaces makes pb_redirect hold exactly ifindexes, the
// egress interfaces that take XDP_REDIRECT, and turns redirecting on in
// pb_config when there is any (otherwise packets go through the stack
// after NAT, XDP_PASS).
func (r *Reconciler) SetRedirectInterfaces(ifindexes []uint32) error {
	if err := r.w.SetRedirect(ifindexes); err != nil {
		return fmt.Errorf("pb_redirect: %w", err)
	}
	var flags uint32
	if len(ifindexes) > 0 {
		flags |= maps.ConfigRedirect
	}
	if err := r.w.SetConfig(flags); err != nil {
		return fmt.Errorf("pb_config: %w", err)
	}
	return nil
}
