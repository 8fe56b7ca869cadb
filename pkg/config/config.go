// Package config reads the standalone agent's YAML config file: the
// interfaces to attach to, the Maglev table size, failure-accrual defaults
// and the services to balance. Parse validates everything up front and
// reports every problem with its field path and value, so that a bad file
// fails at load time with a message that points at the line to fix, never
// half-way through programming the datapath.
//
// Keys are case-sensitive and unknown keys are errors. Failure-accrual
// settings merge field by field: built-in accrual.Defaults(), then
// defaults.failureAccrual, then the service's failureAccrual. A list
// (failureKinds) replaces the inherited list; it does not add to it.
package config

import (
	"errors"
	"fmt"
	"math"
	"net"
	"net/netip"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/penaltybox/penaltybox/pkg/accrual"
	"github.com/penaltybox/penaltybox/pkg/desired"
	"github.com/penaltybox/penaltybox/pkg/maglev"
)

const (
	// DefaultMaglevTableSize is a prime near 2^14: 64 KiB of u32 slots per
	// service. The Maglev paper keeps the table over 100x the backend count
	// for near-even shares, so this suits up to ~160 backends.
	DefaultMaglevTableSize = maglev.DefaultTableSize
	// The accepted range is maglev's (maglev.ValidateTableSize is the rule).
	minMaglevTableSize = maglev.MinTableSize
	maxMaglevTableSize = maglev.MaxTableSize // largest prime below 2^20

	// maxBackends is the per-service cap the schema promises. The datapath
	// has its own, global, limit on backends across all services.
	maxBackends = 65535
	// maxNameLen is the DNS-subdomain length limit Kubernetes names use.
	maxNameLen = 253
)

// Config is a validated config file.
type Config struct {
	// Interfaces get the XDP program. Never empty.
	Interfaces []string
	// RedirectInterfaces is the subset of Interfaces that can take
	// XDP_REDIRECTed frames on egress (a veth only if its peer has an XDP
	// program or GRO enabled). Frames leaving by any other interface are
	// given XDP_PASS after NAT and go through the kernel stack.
	RedirectInterfaces []string
	// MaglevTableSize is prime.
	MaglevTableSize uint32
	// Defaults is accrual.Defaults() with defaults.failureAccrual applied.
	Defaults accrual.Settings
	// Services are in file order; possibly none.
	Services []Service
	// MaxInflight and MaxInflightPerEndpoint are defaults.maxInflight and
	// defaults.maxInflightPerEndpoint: nil when the file does not set them
	// (the agent's --max-inflight-default applies then), 0 for no limit.
	MaxInflight            *uint32
	MaxInflightPerEndpoint *uint32
	// RetryRefused is defaults.retryRefused (true when unset: a refused
	// SYN is replayed to another backend at once).
	RetryRefused bool
}

// Service is one validated services entry.
type Service struct {
	Name string
	// VIP is IPv4 or IPv6 (see checkAddr for what is refused).
	VIP      netip.Addr
	Port     uint16
	Protocol desired.Protocol
	// Backends are of the VIP's family, unique; possibly none, in which
	// case the service drops new flows.
	Backends []netip.AddrPort
	// Accrual is fully merged: built-in, defaults block, service block.
	Accrual accrual.Settings
	// MaxInflight and MaxInflightPerEndpoint are the service's own circuit
	// breaker limits; nil inherits the default.
	MaxInflight            *uint32
	MaxInflightPerEndpoint *uint32
	// RetryRefused is the service's own setting; nil inherits the default.
	RetryRefused *bool
	// SessionAffinity is the service's affinity timeout; 0: none.
	SessionAffinity time.Duration
}

// Load reads and parses the config file at path.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err) // *PathError names path
	}
	c, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	return c, nil
}

// Parse parses and validates a config file. On error the result is nil and
// the error lists the problems (see FieldError), at most maxErrors of them.
func Parse(data []byte) (*Config, error) {
	raw, err := decode(data)
	if err != nil {
		return nil, err
	}
	var errs errList
	c := &Config{
		Interfaces:         parseInterfaces(raw.Interfaces, &errs),
		RedirectInterfaces: parseRedirectInterfaces(raw.RedirectInterfaces, raw.Interfaces, &errs),
		MaglevTableSize:    parseMaglev(raw.Maglev, &errs),
	}

	c.RetryRefused = true
	var rd *rawAccrual
	if raw.Defaults != nil {
		rd = raw.Defaults.FailureAccrual
	}
	// A broken defaults block is reported once, not again for every
	// service that inherits from it.
	var defaultsOK bool
	c.Defaults, defaultsOK = rd.resolve("defaults.failureAccrual", accrual.Defaults(), &errs)
	if raw.Defaults != nil {
		c.MaxInflight = parseLimit(raw.Defaults.MaxInflight, "defaults.maxInflight", &errs)
		c.MaxInflightPerEndpoint = parseLimit(raw.Defaults.MaxInflightPerEndpoint, "defaults.maxInflightPerEndpoint", &errs)
		if raw.Defaults.RetryRefused != nil {
			c.RetryRefused = *raw.Defaults.RetryRefused
		}
	}
	c.Services = parseServices(raw.Services, c.MaglevTableSize, c.Defaults, defaultsOK, &errs)
	if err := errs.err(); err != nil {
		return nil, err
	}
	return c, nil
}

func parseMaglev(m *rawMaglev, errs *errList) uint32 {
	if m == nil || m.TableSize == nil {
		return DefaultMaglevTableSize
	}
	n := *m.TableSize
	// Out-of-uint32 values become out-of-range ones for the check.
	size := uint32(math.MaxUint32)
	if n < 0 {
		size = 0
	} else if n < math.MaxUint32 {
		size = uint32(n)
	}
	err := maglev.ValidateTableSize(size)
	if err == nil {
		return size
	}
	var tse *maglev.TableSizeError
	if errors.As(err, &tse) && tse.NotPrime {
		errs.add("maglev.tableSize", strconv.Itoa(n),
			"must be prime (Maglev needs it so every backend's permutation covers the table), e.g. 16381, 65537")
	} else {
		errs.add("maglev.tableSize", strconv.Itoa(n),
			fmt.Sprintf("must be within [%d, %d]", minMaglevTableSize, maxMaglevTableSize))
	}
	return 0 // invalid; checks that depend on the size are skipped
}

func parseInterfaces(names []string, errs *errList) []string {
	switch {
	case names == nil:
		errs.add("interfaces", "", "required: list the interfaces to attach XDP to")
		return nil
	case len(names) == 0:
		errs.add("interfaces", "[]", "must not be empty")
		return nil
	}
	first := map[string]int{}
	for i, name := range names {
		p := fmt.Sprintf("interfaces[%d]", i)
		if msg := checkIfname(name); msg != "" {
			errs.add(p, strconv.Quote(name), msg)
			continue
		}
		if j, dup := first[name]; dup {
			errs.add(p, strconv.Quote(name), fmt.Sprintf("duplicate of interfaces[%d]", j))
			continue
		}
		first[name] = i
	}
	return append([]string(nil), names...)
}

func parseRedirectInterfaces(names, interfaces []string, errs *errList) []string {
	listed := map[string]bool{}
	for _, n := range interfaces {
		listed[n] = true
	}
	first := map[string]int{}
	for i, name := range names {
		p := fmt.Sprintf("redirectInterfaces[%d]", i)
		if j, dup := first[name]; dup {
			errs.add(p, strconv.Quote(name), fmt.Sprintf("duplicate of redirectInterfaces[%d]", j))
			continue
		}
		first[name] = i
		if !listed[name] {
			errs.add(p, strconv.Quote(name), "not listed in interfaces (a redirect target must also run the XDP program)")
		}
	}
	return append([]string(nil), names...)
}

// checkIfname applies the kernel's dev_valid_name rules (IFNAMSIZ is 16
// with the NUL; no '/', ':' or whitespace; not "." or "..") plus no
// control characters, and returns what is wrong, or "".
func checkIfname(name string) string {
	if name == "" || len(name) > 15 {
		return "interface name must be 1 to 15 bytes long"
	}
	if name == "." || name == ".." {
		return `interface name must not be "." or ".."`
	}
	for _, r := range name {
		if r == '/' || r == ':' || r <= ' ' || r == 0x7f {
			return "interface name must not contain '/', ':', whitespace or control characters"
		}
	}
	return ""
}

var serviceNameRE = regexp.MustCompile(`^[a-z0-9]([-a-z0-9_.:/]*[a-z0-9])?$`)

func parseServices(raws []rawService, tableSize uint32, defaults accrual.Settings, defaultsOK bool, errs *errList) []Service {
	out := make([]Service, 0, len(raws))
	byName := map[string]int{}
	byKey := map[desired.Key]int{}
	for i := range raws {
		p := fmt.Sprintf("services[%d]", i)
		s, keyOK := raws[i].parse(p, defaults, defaultsOK, errs)
		if n := len(s.Backends); tableSize != 0 && n > int(tableSize) {
			// Every backend needs at least one slot of the table.
			errs.add(p+".backends", fmt.Sprintf("%d entries", n),
				fmt.Sprintf("more than maglev.tableSize (%d): raise the table size", tableSize))
		}
		if s.Name != "" {
			if j, dup := byName[s.Name]; dup {
				errs.add(p+".name", strconv.Quote(s.Name), fmt.Sprintf("duplicate of services[%d].name", j))
			} else {
				byName[s.Name] = i
			}
		}
		if keyOK {
			k := desired.Key{VIP: s.VIP, Port: s.Port, Protocol: s.Protocol}
			if j, dup := byKey[k]; dup {
				errs.add(p, k.String(), fmt.Sprintf("service %q uses the same VIP, port and protocol as service %q (services[%d])",
					rawName(raws[i]), rawName(raws[j]), j))
			} else {
				byKey[k] = i
			}
		}
		out = append(out, s)
	}
	return out
}

// rawName is the name as written, valid or not, for messages about
// another field.
func rawName(r rawService) string {
	if r.Name == nil {
		return ""
	}
	return *r.Name
}

// parse validates one service at path p. keyOK reports whether VIP, port
// and protocol are all valid, so duplicates can be looked for.
func (r *rawService) parse(p string, defaults accrual.Settings, defaultsOK bool, errs *errList) (s Service, keyOK bool) {
	switch {
	case r.Name == nil:
		errs.add(p+".name", "", "required")
	case len(*r.Name) > maxNameLen || !serviceNameRE.MatchString(*r.Name):
		errs.add(p+".name", strconv.Quote(*r.Name),
			fmt.Sprintf("must be at most %d characters of a-z, 0-9, '-', '_', '.', ':', '/', starting and ending with a-z or 0-9", maxNameLen))
	default:
		s.Name = *r.Name
	}

	before := errs.count()
	if r.VIP == nil {
		errs.add(p+".vip", "", "required")
	} else if a, err := netip.ParseAddr(*r.VIP); err != nil {
		errs.add(p+".vip", strconv.Quote(*r.VIP), explainBadVIP(*r.VIP))
	} else if msg := checkAddr(a); msg != "" {
		errs.add(p+".vip", strconv.Quote(*r.VIP), msg)
	} else {
		s.VIP = a
	}

	if r.Port == nil {
		errs.add(p+".port", "", "required")
	} else if *r.Port < 1 || *r.Port > 65535 {
		errs.add(p+".port", strconv.Itoa(*r.Port), "must be within [1, 65535]")
	} else {
		s.Port = uint16(*r.Port)
	}

	// Lowercase only, like every other keyword in the file.
	switch {
	case r.Protocol == nil || *r.Protocol == "tcp":
		s.Protocol = desired.TCP
	case *r.Protocol == "udp":
		s.Protocol = desired.UDP
	default:
		errs.add(p+".protocol", strconv.Quote(*r.Protocol), "unknown protocol (want tcp or udp, lowercase)")
	}
	keyOK = errs.count() == before

	s.Backends = parseBackends(r.Backends, p+".backends", s.VIP, errs)

	if defaultsOK {
		s.Accrual, _ = r.FailureAccrual.resolve(p+".failureAccrual", defaults, errs)
	}
	s.MaxInflight = parseLimit(r.MaxInflight, p+".maxInflight", errs)
	s.MaxInflightPerEndpoint = parseLimit(r.MaxInflightPerEndpoint, p+".maxInflightPerEndpoint", errs)
	s.RetryRefused = r.RetryRefused
	setDuration(&s.SessionAffinity, r.SessionAffinity, p+".sessionAffinity", errs)
	if s.SessionAffinity < 0 || s.SessionAffinity > desired.MaxAffinity {
		errs.add(p+".sessionAffinity", strconv.Quote(s.SessionAffinity.String()), "must be within [0s, 24h]")
	}
	return s, keyOK
}

// parseLimit checks a circuit-breaker limit: a count of live flows.
func parseLimit(v *int64, path string, errs *errList) *uint32 {
	if v == nil {
		return nil
	}
	if *v < 0 || *v > math.MaxUint32 {
		errs.add(path, strconv.FormatInt(*v, 10), fmt.Sprintf("must be within [0, %d] (0: no limit)", uint32(math.MaxUint32)))
		return nil
	}
	n := uint32(*v)
	return &n
}

// parseBackends parses a service's backends. A service is one address
// family: every backend must be of the VIP's family (of the first valid
// backend's when the VIP itself is missing or invalid, so that a mixed
// list is still reported).
func parseBackends(raws []string, p string, vip netip.Addr, errs *errList) []netip.AddrPort {
	if len(raws) > maxBackends {
		errs.add(p, fmt.Sprintf("%d entries", len(raws)), fmt.Sprintf("at most %d backends per service", maxBackends))
		return nil
	}
	out := make([]netip.AddrPort, 0, len(raws))
	first := map[netip.AddrPort]int{}
	// ref is the address whose family every backend must have: the VIP's,
	// or without a valid VIP the first valid backend's (refPath).
	ref, refPath := vip, ""
	for i, b := range raws {
		bp := fmt.Sprintf("%s[%d]", p, i)
		ap, msg := parseBackend(b)
		if msg != "" {
			errs.add(bp, strconv.Quote(b), msg)
			continue
		}
		switch {
		case !ref.IsValid():
			ref, refPath = ap.Addr(), fmt.Sprintf("backends[%d]", i)
		case ap.Addr().Is4() != ref.Is4() && refPath == "":
			errs.add(bp, strconv.Quote(b), fmt.Sprintf("an %s backend of an %s service (vip %s): a service's vip and backends must be all IPv4 or all IPv6",
				family(ap.Addr()), family(ref), ref))
			continue
		case ap.Addr().Is4() != ref.Is4():
			errs.add(bp, strconv.Quote(b), fmt.Sprintf("an %s backend, but %s is %s: a service's vip and backends must be all IPv4 or all IPv6",
				family(ap.Addr()), refPath, family(ref)))
			continue
		}
		if j, dup := first[ap]; dup {
			errs.add(bp, strconv.Quote(b), fmt.Sprintf("duplicate of backends[%d]", j))
			continue
		}
		first[ap] = i
		out = append(out, ap)
	}
	return out
}

// family names a's address family for messages.
func family(a netip.Addr) string {
	if a.Is4() {
		return "IPv4"
	}
	return "IPv6"
}

// parseBackend parses "IPv4:port" or "[IPv6]:port" and says what is wrong
// in terms an operator can act on, rather than netip's "not an ip:port".
func parseBackend(s string) (netip.AddrPort, string) {
	if a, err := netip.ParseAddr(s); err == nil {
		if msg := checkAddr(a); msg != "" {
			return netip.AddrPort{}, msg
		}
		if a.Is6() {
			// "2001:db8::1:8080" is an address: the port needs brackets.
			return netip.AddrPort{}, "missing port (an IPv6 backend is written [address]:port, e.g. [2001:2::1:2]:8080)"
		}
		return netip.AddrPort{}, "missing port"
	}
	ap, err := netip.ParseAddrPort(s)
	if err != nil {
		return netip.AddrPort{}, explainBadBackend(s)
	}
	if msg := checkAddr(ap.Addr()); msg != "" {
		return netip.AddrPort{}, msg
	}
	if ap.Port() == 0 {
		return netip.AddrPort{}, "port must be a number within [1, 65535]"
	}
	return ap, ""
}

// explainBadBackend words why s is not IPv4:port or [IPv6]:port: the
// address, the brackets or the port.
func explainBadBackend(s string) string {
	if strings.HasPrefix(s, "[") && strings.HasSuffix(s, "]") {
		if a, err := netip.ParseAddr(s[1 : len(s)-1]); err == nil {
			if msg := checkAddr(a); msg != "" {
				return msg
			}
			return "missing port"
		}
	}
	host, port, err := net.SplitHostPort(s)
	if err == nil {
		if port == "" {
			return "missing port"
		}
		if a, err := netip.ParseAddr(host); err == nil {
			if msg := checkAddr(a); msg != "" {
				return msg
			}
			if n, err := strconv.ParseUint(port, 10, 16); err != nil || n == 0 {
				return "port must be a number within [1, 65535]"
			}
			if a.Is4() && strings.HasPrefix(s, "[") {
				return "square brackets are for IPv6 addresses: write an IPv4 backend as " + host + ":" + port
			}
		}
	}
	return "want IPv4:port or [IPv6]:port, e.g. 198.18.1.2:8080 or [2001:2::1:2]:8080"
}

// explainBadVIP words why s is not an address.
func explainBadVIP(s string) string {
	if strings.HasPrefix(s, "[") && strings.HasSuffix(s, "]") {
		if _, err := netip.ParseAddr(s[1 : len(s)-1]); err == nil {
			return "write an IPv6 vip without brackets, e.g. 2001:2::10"
		}
	}
	return "not an IPv4 or IPv6 address"
}

var broadcast = netip.AddrFrom4([4]byte{255, 255, 255, 255})

// checkAddr rejects addresses that cannot be a VIP or a backend, because
// they can never carry a unicast flow to another host or because the
// datapath could not tell which flow is whose:
//
//   - IPv4-mapped IPv6 addresses (::ffff:198.18.1.2) are rejected, not
//     normalized: traffic to such an address travels as IPv4, so the
//     plain IPv4 form is what the datapath matches (and a silent
//     conversion would let one file spell a service two ways).
//   - IPv6 zones (fe80::1%eth0): the maps hold no interface.
//   - IPv6 link-local unicast (fe80::/10): without a zone it names no one
//     link. (IPv4 link-local, 169.254.0.0/16, stays allowed: node-local
//     VIPs such as NodeLocal DNSCache's 169.254.20.10 live there.)
//   - unspecified, loopback, multicast (either family) and the IPv4
//     broadcast address.
func checkAddr(a netip.Addr) string {
	switch {
	case a.Zone() != "":
		return "must not have a zone (%" + a.Zone() + "): the datapath does not keep one"
	case a.Is4In6():
		return "IPv4-mapped IPv6 address: write it as plain IPv4 (" + a.Unmap().String() + ")"
	case a.IsUnspecified():
		return "must not be the unspecified address"
	case a.IsLoopback():
		return "must not be a loopback address"
	case a.IsMulticast():
		return "must not be a multicast address"
	case a == broadcast:
		return "must not be the broadcast address"
	case a.Is6() && a.IsLinkLocalUnicast():
		return "must not be an IPv6 link-local address (fe80::/10)"
	}
	return ""
}

// Desired converts c to the reconciler's input. Endpoint names are empty in
// standalone mode. The result shares no memory with c.
// limit resolves a circuit-breaker limit: the service's own, else the
// default, else none.
func limit(own, def *uint32) uint32 {
	switch {
	case own != nil:
		return *own
	case def != nil:
		return *def
	}
	return 0
}

func (c *Config) Desired() desired.State {
	st := desired.State{Services: make([]desired.Service, 0, len(c.Services))}
	for _, s := range c.Services {
		eps := make([]desired.Endpoint, 0, len(s.Backends))
		for _, b := range s.Backends {
			eps = append(eps, desired.Endpoint{Addr: b})
		}
		st.Services = append(st.Services, desired.Service{
			Name:                   s.Name,
			Key:                    desired.Key{VIP: s.VIP, Port: s.Port, Protocol: s.Protocol},
			Endpoints:              eps,
			Accrual:                s.Accrual,
			MaxInflight:            limit(s.MaxInflight, c.MaxInflight),
			MaxInflightPerEndpoint: limit(s.MaxInflightPerEndpoint, c.MaxInflightPerEndpoint),
			RetryRefused:           c.RetryRefused,
			Affinity:               s.SessionAffinity,
		})
		if s.RetryRefused != nil {
			st.Services[len(st.Services)-1].RetryRefused = *s.RetryRefused
		}
	}
	return st
}
