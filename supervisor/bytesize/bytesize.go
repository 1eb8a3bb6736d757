// Package bytesize reads sizes as people write them on command lines.
package bytesize

import (
	"fmt"
	"strconv"
	"strings"
	"unicode"
)

// Parse reads sizes such as 512M, 2G, 2GiB, 64K or 1048576 (bytes when no
// unit; the units are binary).
func Parse(s string) (uint64, error) {
	s = strings.TrimSpace(s)
	i := strings.IndexFunc(s, func(r rune) bool { return !unicode.IsDigit(r) })
	num, unit := s, ""
	if i >= 0 {
		num, unit = s[:i], strings.ToUpper(s[i:])
	}
	n, err := strconv.ParseUint(num, 10, 64)
	if err != nil || num == "" {
		return 0, fmt.Errorf("invalid size %q", s)
	}
	unit = strings.TrimSuffix(strings.TrimSuffix(unit, "B"), "I")
	shift := map[string]uint{"": 0, "K": 10, "M": 20, "G": 30, "T": 40}
	sh, ok := shift[unit]
	if !ok {
		return 0, fmt.Errorf("invalid size unit in %q", s)
	}
	if n > (1<<63)>>sh {
		return 0, fmt.Errorf("size %q is too large", s)
	}
	return n << sh, nil
}
