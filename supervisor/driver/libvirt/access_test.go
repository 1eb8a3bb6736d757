package libvirt

import (
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"syscall"
	"testing"
)

func TestACLEncoding(t *testing.T) {
	// A 0750 directory, then uid 1000 given search.
	acl := []aclEntry{{aclUserObj, 7, aclNoID}, {aclGroupObj, 5, aclNoID}, {aclOther, 0, aclNoID}}
	got := addUserPerm(acl, 1000, permSearch)
	want := []aclEntry{{aclUserObj, 7, aclNoID}, {aclUser, 1, 1000}, {aclGroupObj, 5, aclNoID}, {aclMask, 5, aclNoID}, {aclOther, 0, aclNoID}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("add: got %v, want %v", got, want)
	}
	back, err := decodeACL(encodeACL(got))
	if err != nil || !reflect.DeepEqual(back, got) {
		t.Fatalf("round trip: %v %v", back, err)
	}
	if !hasPerm(got, 1000, permSearch) || hasPerm(got, 1000, permRead) || hasPerm(got, 1001, permSearch) {
		t.Error("hasPerm")
	}
	// Adding read to the same user merges, and the mask follows.
	got = addUserPerm(got, 1000, permRead)
	if !hasPerm(got, 1000, permRead|permSearch) || len(got) != 5 {
		t.Errorf("merge: %v", got)
	}
	// A mask that hides the user's entry does not count as access.
	masked := []aclEntry{{aclUserObj, 7, aclNoID}, {aclUser, 5, 1000}, {aclGroupObj, 0, aclNoID}, {aclMask, 0, aclNoID}, {aclOther, 0, aclNoID}}
	if hasPerm(masked, 1000, permRead) {
		t.Error("masked entry counted")
	}
	if _, err := decodeACL([]byte{2, 0, 0, 0, 1}); err == nil {
		t.Error("decoded a torn acl")
	}
}

// TestGrantRead checks, as root, that the user QEMU runs as can read a
// file deep in 0700 directories after grantRead, and that nobody else
// can.
func TestGrantRead(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: it runs commands as other users")
	}
	const qemuUID, otherUID = 65534, 65533
	root := t.TempDir()
	dir := filepath.Join(root, "state", "images")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	os.Chmod(root, 0o700)
	file := filepath.Join(dir, "kernel")
	if err := os.WriteFile(file, []byte("vmlinuz"), 0o600); err != nil {
		t.Fatal(err)
	}
	canRead := func(uid uint32) bool {
		cmd := exec.Command("/bin/cat", file)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
		out, err := cmd.Output()
		return err == nil && string(out) == "vmlinuz"
	}
	if canRead(qemuUID) {
		t.Fatal("readable before the grant: the test proves nothing")
	}
	changed, err := grantRead(file, qemuUID)
	if err != nil {
		t.Fatal(err)
	}
	if len(changed) < 3 || changed[len(changed)-1] != file {
		t.Errorf("changed %v", changed)
	}
	if !canRead(qemuUID) {
		t.Error("qemu's user cannot read the file after the grant")
	}
	if canRead(otherUID) {
		t.Error("another user can read the file")
	}
	// Search only: the user cannot list the directories it passes.
	ls := exec.Command("/bin/ls", dir)
	ls.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: qemuUID, Gid: qemuUID}}
	if ls.Run() == nil {
		t.Error("qemu's user can list the directory")
	}
	st, _ := os.Stat(file)
	if st.Mode().Perm()&0o007 != 0 {
		t.Errorf("other bits changed: %v", st.Mode())
	}
	again, err := grantRead(file, qemuUID)
	if err != nil || len(again) != 0 {
		t.Errorf("second grant changed %v, %v", again, err)
	}
}

// TestGrantReadWrite checks, as root, that after grantReadWrite the user
// QEMU runs as can write a file (a workspace disk) in 0700 directories.
func TestGrantReadWrite(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: it runs commands as other users")
	}
	const qemuUID = 65534
	root := t.TempDir()
	os.Chmod(root, 0o700)
	dir := filepath.Join(root, "vms", "demo")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "workspace.qcow2")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	write := func() error {
		cmd := exec.Command("/bin/sh", "-c", "echo written >> "+file)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: qemuUID, Gid: qemuUID}}
		return cmd.Run()
	}
	if write() == nil {
		t.Fatal("writable before the grant: the test proves nothing")
	}
	if _, err := grantRead(file, qemuUID); err != nil {
		t.Fatal(err)
	}
	if write() == nil {
		t.Error("a read grant let the user write")
	}
	if _, err := grantReadWrite(file, qemuUID); err != nil {
		t.Fatal(err)
	}
	if err := write(); err != nil {
		t.Errorf("qemu's user cannot write after the grant: %v", err)
	}
	if b, _ := os.ReadFile(file); string(b) != "written\n" {
		t.Errorf("file holds %q", b)
	}
}
