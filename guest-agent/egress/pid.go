package egress

import (
	"bufio"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// maxProcs bounds how many processes PeerPID looks through.
const maxProcs = 4096

// PeerPID returns the pid of the process that holds the client end of a
// loopback TCP connection from client to proxy (both "ip:port"), from
// /proc/net/tcp{,6} and /proc/PID/fd, or 0 when it cannot tell (the
// process has gone, or the socket is shared). It needs root to see other
// users' descriptors.
func PeerPID(client, proxy string) int32 {
	return peerPID("/proc", client, proxy)
}

func peerPID(proc, client, proxy string) int32 {
	c, err1 := netip.ParseAddrPort(client)
	p, err2 := netip.ParseAddrPort(proxy)
	if err1 != nil || err2 != nil {
		return 0
	}
	table := "net/tcp"
	if c.Addr().Is6() && !c.Addr().Is4In6() {
		table = "net/tcp6"
	}
	inode := socketInode(filepath.Join(proc, table), procAddr(c), procAddr(p))
	if inode == "" {
		return 0
	}
	return inodeOwner(proc, "socket:["+inode+"]")
}

// procAddr writes a as /proc/net/tcp does: the address's 32-bit words in
// the kernel's (little-endian) order, in hex, then the port.
func procAddr(a netip.AddrPort) string {
	ip := a.Addr().Unmap()
	var sb strings.Builder
	b := ip.AsSlice()
	for i := 0; i < len(b); i += 4 {
		fmt.Fprintf(&sb, "%02X%02X%02X%02X", b[i+3], b[i+2], b[i+1], b[i])
	}
	fmt.Fprintf(&sb, ":%04X", a.Port())
	return sb.String()
}

// socketInode finds the inode of the socket from local to remote.
func socketInode(table, local, remote string) string {
	f, err := os.Open(table)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		// sl local rem st tx:rx tr:when retrnsmt uid timeout inode
		if len(fields) >= 10 && fields[1] == local && fields[2] == remote {
			return fields[9]
		}
	}
	return ""
}

// inodeOwner returns the one process with a descriptor on link, or 0.
func inodeOwner(proc, link string) int32 {
	ents, err := os.ReadDir(proc)
	if err != nil {
		return 0
	}
	var owner int32
	seen := 0
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 0 {
			continue
		}
		if seen++; seen > maxProcs {
			return 0
		}
		fdDir := filepath.Join(proc, e.Name(), "fd")
		fds, err := os.ReadDir(fdDir)
		if err != nil {
			continue
		}
		for _, fd := range fds {
			if l, err := os.Readlink(filepath.Join(fdDir, fd.Name())); err == nil && l == link {
				if owner != 0 && owner != int32(pid) {
					return 0 // shared (a fork): no one process to name
				}
				owner = int32(pid)
				break
			}
		}
	}
	return owner
}
