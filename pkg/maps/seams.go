// SPDX-License-Identifier: Apache-2.0

package maps

import "github.com/penaltybox/penaltybox/bpf"

// The pinned maps, one small interface per map or family of maps, as the
// packages above take them: *Maps implements every one, and
// pkg/maps/mapsfake's in-memory kernel does too, for tests. pkg/reconcile,
// the one writer, takes the writers; the agent and pkg/metrics read the
// counters and the trip arrays.

// ServiceMap is pb_services, each service's active backends
// (pb_svc_backends), its counters' reset and its session affinity.
type ServiceMap interface {
	UpsertService(bpf.LbSvcKey, bpf.LbSvcValue) error
	// DeleteService deletes the entry and the service's tables; with id
	// 0, the entry alone.
	DeleteService(bpf.LbSvcKey, uint32) error
	Services() (map[bpf.LbSvcKey]bpf.LbSvcValue, error)
	SetServiceBackends(svcID uint32, old, ids []uint32) error
	ServiceBackends(svcID uint32, n uint32) ([]uint32, error)
	ResetServiceStats(svcID uint32) error
	ForgetAffinity(svcID uint32) error
}

// BackendMap is pb_backends and its counters' reset.
type BackendMap interface {
	SetBackend(uint32, bpf.LbBackend) error
	SetBackends(ids []uint32, vals []bpf.LbBackend) error
	ClearBackend(uint32) error
	Backend(uint32) (bpf.LbBackend, error)
	Backends() (map[uint32]bpf.LbBackend, error)
	ResetBackendStats(ids []uint32) error
}

// TableMap is the Maglev tables: two per service (pb_maglev) and a
// fallback (pb_maglev_fb). FillTable and SetFallback copy slots: the
// caller may reuse the slice at once.
type TableMap interface {
	InstallTables([]TableInstall) error
	FillTable(svcID, n uint32, slots []uint32) error
	TableSizes(svcID uint32) ([2]uint32, error)
	SetFallback(svcID uint32, slots []uint32) error
	// TableHandles and ReleaseTable bound the agent's open files: one
	// per table it can still write.
	TableHandles() int
	ReleaseTable(svcID, n uint32)
}

// PrefilterMap is the two prefilters, pb_ports and pb_vip_slots.
type PrefilterMap interface {
	SetPorts(old, roles map[uint16]uint8) error
	Ports() (map[uint16]uint8, error)
	SetVIPSlots(old, want map[uint32]bool) error
	VIPSlots() (map[uint32]bool, error)
}

// TripReader reads the kernel-trip arrays: a service's settings, budget
// and trips (pb_svc_trip), a backend's streak (pb_be_trip).
type TripReader interface {
	ServiceTrip(svcID uint32) bpf.LbSvcTrip
	BackendTrip(id uint32) bpf.LbBeTrip
}

// TripMap is the kernel-trip arrays, read and written.
type TripMap interface {
	TripReader
	SetServiceTrip(svcID uint32, s TripSettings, budget int64)
	ResetServiceTrip(svcID uint32)
	ResetBackendTrip(id uint32)
}

// PersistedState is the accrual state kept across restarts (pb_health).
type PersistedState interface {
	PutPersisted(id uint32, h bpf.LbEndpointHealth) error
	DeletePersisted(id uint32) error
	Persisted() (map[uint32]bpf.LbEndpointHealth, error)
}

// InterfaceMap is the node's side of the datapath: its interfaces
// (pb_ifaces), the redirect targets (pb_redirect) and the settings
// (pb_config_v2).
type InterfaceMap interface {
	SetIfaces([]Iface) error
	SetRedirect(ifindexes []uint32) error
	SetConfig(Config) error
}

// SYNGuardMap is the SYN guard (pb_syn_guard).
type SYNGuardMap interface {
	SetSYNGuard(SYNGuard) error
}

// Counters reads the datapath's counters.
type Counters interface {
	GlobalStats() (bpf.LbGlobalStats, error)
	ServiceStats(id uint32) (bpf.LbSvcStats, error)
	BackendStats(id uint32) (bpf.LbBeStats, error)
	SYNGuardStats() (bpf.LbSynGuardCpu, error)
	NFForgotten() (NFForgotten, error)
	AffinityFill() (entries, capacity int, err error)
}

var (
	_ ServiceMap     = (*Maps)(nil)
	_ BackendMap     = (*Maps)(nil)
	_ TableMap       = (*Maps)(nil)
	_ PrefilterMap   = (*Maps)(nil)
	_ TripMap        = (*Maps)(nil)
	_ PersistedState = (*Maps)(nil)
	_ InterfaceMap   = (*Maps)(nil)
	_ SYNGuardMap    = (*Maps)(nil)
	_ Counters       = (*Maps)(nil)
)
