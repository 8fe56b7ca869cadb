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

// SetTableWorkers makes InstallTables create tables on up to cpus
// goroutines, from n tables each; it returns the function that restores
// the defaults.
func SetTableWorkers(n, cpus int) (restore func()) {
	oldN, oldCPUs := tablesPerWorker, tableCPUs
	tablesPerWorker, tableCPUs = n, func() int { return cpus }
	return func() { tablesPerWorker, tableCPUs = oldN, oldCPUs }
}

// ResetCounters is resetCounters: the counters' reset alone, without the
// circuit-breaker counts beside it.
func (m *Maps) ResetCounters(ids []uint32, backend bool) error { return m.resetCounters(ids, backend) }
