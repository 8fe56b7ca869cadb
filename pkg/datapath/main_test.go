// SPDX-License-Identifier: Apache-2.0

package datapath_test

import (
	"testing"

	"github.com/penaltybox/penaltybox/internal/bpftest"
)

// TestMain unmounts the bpffs of the datapath the tests share
// (bpftest.Shared).
func TestMain(m *testing.M) { bpftest.Main(m) }
