package gpu

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// vendorNames name the usual GPU vendors when no pci.ids file is found.
var vendorNames = map[uint16]string{
	0x10de: "NVIDIA Corporation",
	0x1002: "Advanced Micro Devices, Inc. [AMD/ATI]",
	0x8086: "Intel Corporation",
	0x1a03: "ASPEED Technology, Inc.",
	0x102b: "Matrox Electronics Systems Ltd.",
	0x1234: "QEMU",
	0x1af4: "Red Hat, Inc.",
	0x1b36: "Red Hat, Inc.",
}

// name fills in each GPU's Name from the first pci.ids file that exists,
// read once for all of them, falling back to the vendor's name alone.
func (h *Host) name(gpus []GPU) {
	if len(gpus) == 0 {
		return
	}
	type key struct{ vendor, device uint16 }
	want := map[key]string{}
	vendors := map[uint16]string{}
	for _, g := range gpus {
		want[key{g.VendorID, g.DeviceID}] = ""
		vendors[g.VendorID] = ""
	}
	for _, path := range h.ids {
		f, err := os.Open(path)
		if err != nil {
			continue
		}
		// The format: a vendor line "10de  NVIDIA Corporation", its devices
		// indented by a tab ("\t2204  GA102 [GeForce RTX 3090]"),
		// subsystems by two; device classes follow, from "C 00".
		var vendor uint16
		inWanted := false
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			line := sc.Text()
			if line == "" || line[0] == '#' {
				continue
			}
			if strings.HasPrefix(line, "C ") {
				break
			}
			if line[0] != '\t' {
				id, name, ok := idLine(line)
				if !ok {
					inWanted = false
					continue
				}
				vendor = id
				_, inWanted = vendors[vendor]
				if inWanted {
					vendors[vendor] = name
				}
				continue
			}
			if !inWanted || strings.HasPrefix(line, "\t\t") {
				continue
			}
			if id, name, ok := idLine(line[1:]); ok {
				if _, ok := want[key{vendor, id}]; ok {
					want[key{vendor, id}] = name
				}
			}
		}
		f.Close()
		break
	}
	for i := range gpus {
		g := &gpus[i]
		vendor := vendors[g.VendorID]
		if vendor == "" {
			vendor = vendorNames[g.VendorID]
		}
		device := want[key{g.VendorID, g.DeviceID}]
		switch {
		case vendor != "" && device != "":
			g.Name = fmt.Sprintf("%s %s", vendor, device)
		default:
			g.Name = vendor
		}
	}
}

// idLine reads "xxxx  name".
func idLine(s string) (uint16, string, bool) {
	if len(s) < 7 || s[4] != ' ' || s[5] != ' ' {
		return 0, "", false
	}
	v, err := strconv.ParseUint(s[:4], 16, 16)
	if err != nil {
		return 0, "", false
	}
	return uint16(v), strings.TrimSpace(s[6:]), true
}
