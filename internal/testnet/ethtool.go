// SPDX-License-Identifier: Apache-2.0

package testnet

import (
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The ethtool binary is not installed on the test hosts, rtnetlink cannot
// toggle offload features, and vishvananda/netlink has no ethtool-netlink
// (genetlink "ethtool") support. The legacy SIOCETHTOOL one-feature ioctls
// (ETHTOOL_[GS]GRO, ETHTOOL_[GS]TXCSUM) are still served by the kernel
// (net/ethtool/ioctl.c) and are all we need. The ioctl resolves the
// interface name in the namespace of the socket it is issued on, so these
// helpers must run inside NS.Do.

// ethtoolValue is struct ethtool_value.
type ethtoolValue struct {
	cmd  uint32
	data uint32
}

// ifreqData is struct ifreq with ifr_data set; the pointer stays a real
// pointer (not bytes) so the GC keeps the target alive.
type ifreqData struct {
	name [unix.IFNAMSIZ]byte
	data unsafe.Pointer
	_    [24 - unsafe.Sizeof(uintptr(0))]byte
}

func ethtoolCmd(ifname string, cmd, data uint32) (uint32, error) {
	if len(ifname) >= unix.IFNAMSIZ {
		return 0, fmt.Errorf("interface name %q too long", ifname)
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	v := ethtoolValue{cmd: cmd, data: data}
	var ifr ifreqData
	copy(ifr.name[:], ifname)
	ifr.data = unsafe.Pointer(&v)
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&ifr)))
	runtime.KeepAlive(&v)
	if errno != 0 {
		return 0, errno
	}
	return v.data, nil
}

// setFeature sets (set=ETHTOOL_S*) and reads back (get=ETHTOOL_G*) a legacy
// ethtool feature flag on ifname in the calling thread's namespace.
func setFeature(ifname string, set, get uint32, on bool) error {
	want := uint32(0)
	if on {
		want = 1
	}
	if _, err := ethtoolCmd(ifname, set, want); err != nil {
		return fmt.Errorf("testnet: ethtool cmd %#x on %s: %w", set, ifname, err)
	}
	got, err := ethtoolCmd(ifname, get, 0)
	if err != nil {
		return fmt.Errorf("testnet: ethtool cmd %#x on %s: %w", get, ifname, err)
	}
	if got != want {
		return fmt.Errorf("testnet: ethtool cmd %#x on %s: feature is %d after setting %d", set, ifname, got, want)
	}
	return nil
}

// featureGRO reports whether GRO is on for ifname (inside NS.Do).
func featureGRO(ifname string) (bool, error) {
	v, err := ethtoolCmd(ifname, unix.ETHTOOL_GGRO, 0)
	return v != 0, err
}

// featureTxCsum reports whether tx checksum offload is on (inside NS.Do).
func featureTxCsum(ifname string) (bool, error) {
	v, err := ethtoolCmd(ifname, unix.ETHTOOL_GTXCSUM, 0)
	return v != 0, err
}

// Features reports GRO and tx-checksum offload for ifname in the namespace,
// as `ethtool -k` would.
func (n *NS) Features(ifname string) (gro, txCsum bool, err error) {
	err = n.Do(func() error {
		var err error
		if gro, err = featureGRO(ifname); err != nil {
			return err
		}
		txCsum, err = featureTxCsum(ifname)
		return err
	})
	return
}
