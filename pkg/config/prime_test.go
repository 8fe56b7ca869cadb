// SPDX-License-Identifier: Apache-2.0

package config

import (
	"math"

	"github.com/penaltybox/penaltybox/pkg/maglev"
)

// isPrime is maglev.IsPrime for the int values the config tests use; the
// table-size rule itself is maglev.ValidateTableSize.
func isPrime(n int) bool {
	return n >= 0 && n <= math.MaxUint32 && maglev.IsPrime(uint32(n))
}
