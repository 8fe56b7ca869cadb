module github.com/penaltybox/penaltybox

go 1.26.0

require (
	github.com/cilium/ebpf v0.22.0
	github.com/google/gopacket v1.1.19
	github.com/prometheus/client_golang v1.25.0
	github.com/prometheus/client_model v0.6.3
	github.com/prometheus/common v0.72.0
	github.com/vishvananda/netlink v1.3.1
	golang.org/x/sys v0.48.0
	k8s.io/utils v0.0.0-20261023123148-ca04ba58ecab
	sigs.k8s.io/yaml v1.6.0
)

require (
	github.com/beorn7/perks v1.0.1 // indirect
	github.com/cespare/xxhash/v2 v2.3.0 // indirect
	github.com/munnerz/goautoneg v0.0.0-20191010083416-a7dc8b61c822 // indirect
	github.com/prometheus/procfs v0.22.0 // indirect
	github.com/vishvananda/netns v0.0.5 // indirect
	go.yaml.in/yaml/v2 v2.4.4 // indirect
	google.golang.org/protobuf v1.36.12 // indirect
)

tool github.com/cilium/ebpf/cmd/bpf2go
