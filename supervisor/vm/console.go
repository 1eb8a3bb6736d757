package vm

import (
	"path/filepath"

	"github.com/carrel-os/carrel/supervisor/console"
)

// Console returns the end of a VM's serial console log, across its boots
// (running or not): at most n bytes, and whether there were more before
// them.
func (m *Manager) Console(name string, n int64) ([]byte, bool, error) {
	if _, err := m.get(name); err != nil {
		return nil, false, err
	}
	return console.ReadTail(filepath.Join(m.cfg.Registry.Dir(name), console.LogName), n)
}
