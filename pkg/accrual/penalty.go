// SPDX-License-Identifier: Apache-2.0

package accrual

import (
	"math"
	"time"
)

// basePenalty is MinPenalty doubled level times, capped at MaxPenalty.
func basePenalty(s *Settings, level uint8) time.Duration {
	p := s.MinPenalty
	for range level {
		if p >= s.MaxPenalty/2 {
			return s.MaxPenalty
		}
		p *= 2
	}
	return min(p, s.MaxPenalty)
}

// clampLevel lowers level to the first one whose base penalty reaches
// MaxPenalty: levels are only ever incremented below the cap, so a higher
// one (kept across a settings change or read from a record) would otherwise
// show a doubling count the settings cannot produce.
func clampLevel(s *Settings, level uint8) uint8 {
	for level > 0 && basePenalty(s, level-1) >= s.MaxPenalty {
		level--
	}
	return level
}

// maxDrawn is the longest penalty the settings can draw; used to clamp
// penalties drawn under other settings or restored from disk.
func maxDrawn(s *Settings) time.Duration {
	return saturate(float64(s.MaxPenalty) * (1 + s.JitterRatio))
}

// saturate converts f nanoseconds to a Duration, clamped to [0, the
// largest Duration]: converting a float beyond int64's range is
// implementation-defined in Go (on amd64 it yields the most negative
// int64, a penalty that has ended before it began).
func saturate(f float64) time.Duration {
	switch {
	case !(f > 0): // also NaN
		return 0
	case f >= math.MaxInt64:
		return math.MaxInt64
	}
	return time.Duration(f)
}

// drawPenalty jitters p uniformly within [p·(1−j), p·(1+j)].
func (e *Engine) drawPenalty(p time.Duration, j float64) time.Duration {
	if j == 0 {
		return p
	}
	r := e.rnd()
	if !(r >= 0) { // NaN or negative from a broken source
		r = 0
	} else if r > 1 {
		r = 1
	}
	return saturate(float64(p) * (1 + j*(2*r-1)))
}
