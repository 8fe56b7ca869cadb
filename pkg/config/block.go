// SPDX-License-Identifier: Apache-2.0

package config

import (
	"bytes"
	"encoding/json"

	"github.com/penaltybox/penaltybox/pkg/accrual"
)

// ResolveFailureAccrual reads a failureAccrual block given as JSON (as a
// Kubernetes BackendPolicy's spec.failureAccrual is stored), with the
// config file's field names, units and rules, overlays the fields it sets
// onto base (which must be valid) and validates the result. Errors are
// *FieldErrors at paths under path ("spec.failureAccrual.minPenalty"),
// joined; on error base is returned unchanged. Empty or null JSON yields
// base.
func ResolveFailureAccrual(path string, block []byte, base accrual.Settings) (accrual.Settings, error) {
	block = bytes.TrimSpace(block)
	if len(block) == 0 || string(block) == "null" {
		return base, nil
	}
	var errs errList
	var tree any
	d := json.NewDecoder(bytes.NewReader(block))
	d.UseNumber()
	if err := d.Decode(&tree); err != nil {
		errs.add(path, "", "invalid JSON: "+err.Error())
		return base, errs.err()
	}
	raw, err := decodeShaped[rawAccrual](path, block, tree)
	if err != nil {
		return base, err
	}
	s, ok := raw.resolve(path, base, &errs)
	if !ok {
		return base, errs.err()
	}
	return s, nil
}
