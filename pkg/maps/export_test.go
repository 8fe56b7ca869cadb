// SPDX-License-Identifier: Apache-2.0

package maps

// SetResetChunk makes ResetBackendStats write n ids per batch, so a test
// with the small maps of a test datapath crosses batches; it returns the
// function that restores the size.
func SetResetChunk(n int) (restore func()) {
	old := resetChunk
	resetChunk = n
	return func() { resetChunk = old }
}

// SetTablesPerWorker makes InstallTables create tables on several
// goroutines from n tables per CPU; it returns the function that restores
// the threshold.
func SetTablesPerWorker(n int) (restore func()) {
	old := tablesPerWorker
	tablesPerWorker = n
	return func() { tablesPerWorker = old }
}
