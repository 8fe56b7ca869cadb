module github.com/penaltybox/penaltybox

go 1.26.0

require (
	github.com/cilium/ebpf v0.22.0 // indirect
	github.com/google/gopacket v1.1.19 // indirect
	github.com/vishvananda/netlink v1.3.1 // indirect
	github.com/vishvananda/netns v0.0.5 // indirect
	go.yaml.in/yaml/v2 v2.4.4 // indirect
	golang.org/x/sys v0.47.0 // indirect
	k8s.io/client-go v0.37.2 // indirect
	k8s.io/utils v0.0.0-20261023123148-ca04ba58ecab // indirect
	sigs.k8s.io/yaml v1.6.0 // indirect
)

tool github.com/cilium/ebpf/cmd/bpf2go
