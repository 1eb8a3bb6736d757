package protocol

import (
	"fmt"
	"regexp"
	"sync"
)

var vmNameRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[a-z][a-z0-9-]{0,62}$`) })

// ValidVMName reports whether name can name a VM, in VMHeader and
// everywhere else: 1-63 characters of lower-case letters, digits and '-',
// starting with a letter. Such a name is also safe as a path component.
func ValidVMName(name string) error {
	if !vmNameRE().MatchString(name) {
		return fmt.Errorf("invalid vm name %q: use 1-63 lower-case letters, digits and '-', starting with a letter", name)
	}
	return nil
}
