// Package kmodtest builds tiny synthetic kernel modules and module trees for
// tests: ELF files that carry only a .modinfo section.
package kmodtest

import (
	"bytes"
	"debug/elf"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// ELF returns a minimal x86-64 ELF relocatable whose .modinfo section holds
// the given "key=value" entries, NUL terminated as the kernel lays them out.
func ELF(modinfo ...string) []byte {
	shstrtab := []byte("\x00.shstrtab\x00.modinfo\x00")
	var info []byte
	for _, kv := range modinfo {
		info = append(info, kv...)
		info = append(info, 0)
	}
	const ehsize, shentsize = 64, 64
	shstrOff := uint64(ehsize)
	infoOff := shstrOff + uint64(len(shstrtab))
	shOff := (infoOff + uint64(len(info)) + 7) &^ 7

	var b bytes.Buffer
	hdr := elf.Header64{
		Type:      uint16(elf.ET_REL),
		Machine:   uint16(elf.EM_X86_64),
		Version:   uint32(elf.EV_CURRENT),
		Shoff:     shOff,
		Ehsize:    ehsize,
		Shentsize: shentsize,
		Shnum:     3,
		Shstrndx:  1,
	}
	copy(hdr.Ident[:], elf.ELFMAG)
	hdr.Ident[elf.EI_CLASS] = byte(elf.ELFCLASS64)
	hdr.Ident[elf.EI_DATA] = byte(elf.ELFDATA2LSB)
	hdr.Ident[elf.EI_VERSION] = byte(elf.EV_CURRENT)
	mustWrite(&b, hdr)
	b.Write(shstrtab)
	b.Write(info)
	b.Write(make([]byte, int(shOff)-b.Len()))
	mustWrite(&b, elf.Section64{})
	mustWrite(&b, elf.Section64{Name: 1, Type: uint32(elf.SHT_STRTAB), Off: shstrOff, Size: uint64(len(shstrtab)), Addralign: 1})
	mustWrite(&b, elf.Section64{Name: 11, Type: uint32(elf.SHT_PROGBITS), Flags: uint64(elf.SHF_ALLOC), Off: infoOff, Size: uint64(len(info)), Addralign: 1})
	return b.Bytes()
}

func mustWrite(b *bytes.Buffer, v any) {
	if err := binary.Write(b, binary.LittleEndian, v); err != nil {
		panic(err) // writes of fixed-size structs to a buffer cannot fail
	}
}

// Module describes one synthetic module of a tree.
type Module struct {
	// Rel is the file's path under the release directory, e.g.
	// "kernel/drivers/virtio/virtio.ko".
	Rel string
	// Depends are the module names written to depends=.
	Depends []string
}

// WriteTree writes mods under dir/<release> with name, depends and a
// vermagic for release, and returns that release directory.
func WriteTree(dir, release string, mods ...Module) (string, error) {
	root := filepath.Join(dir, release)
	for _, m := range mods {
		name := strings.ReplaceAll(strings.TrimSuffix(filepath.Base(m.Rel), ".ko"), "-", "_")
		image := ELF(
			"license=GPL",
			"depends="+strings.Join(m.Depends, ","),
			"name="+name,
			"vermagic="+release+" SMP preempt mod_unload modversions ",
		)
		p := filepath.Join(root, filepath.FromSlash(m.Rel))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return "", fmt.Errorf("write module tree: %w", err)
		}
		if err := os.WriteFile(p, image, 0o644); err != nil {
			return "", fmt.Errorf("write module tree: %w", err)
		}
	}
	return root, nil
}
