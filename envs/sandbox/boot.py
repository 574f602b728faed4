"""First stage of a sandboxed run: set up isolation from inside, then exec the untrusted code
(stdlib only).

``leafe.envs.sandbox.launch`` runs this file as ``[unshare ...] python -I -S -B sandbox_boot.py
<plan json>``; it is trusted code that runs with the privileges needed to build the sandbox (root,
or root of a fresh user namespace) and drops them before the code starts. With isolation
``namespaces`` it is already inside new mount, PID and network namespaces (and a user namespace when
not root) and:

1. builds a new root on a tmpfs: read-only bind mounts of the interpreter's directories only
   (``/usr``, ``/lib*``, the interpreter's prefix; no ``/etc``, ``/home``, ``/run`` or ``/var``, so
   no mounted secret), a fresh ``/proc`` of the new PID namespace, a ``/dev`` with ``null``,
   ``zero``, ``full``, ``random`` and ``urandom``, and ``/tmp``: a tmpfs of ``disk_kb`` that is the
   code's working directory and the only writable place;
2. makes the whole tree read-only (``mount_setattr`` recursively; per mount where that syscall is
   missing) and verifies it, then ``pivot_root``s into it and detaches the old root;
3. forks the code's process and stays as the namespace's PID 1 (an init without capabilities that
   reaps orphans and writes the code's wait status on the status pipe; when it exits, every process
   left in the namespace is killed);
4. in the code's process: sets the resource limits, ``PR_SET_NO_NEW_PRIVS``, empties the capability
   bounding set and drops every privilege: as real root it switches to the run's fresh uid; in a
   user namespace it locks the secure bits (``SECBIT_NOROOT``), so the exec leaves the code no
   capability; then a seccomp filter denies the code (and its children) any new namespace: no nested
   user namespace;
5. writes ``ok`` on the ready pipe (both pipes are closed on exec, so the code never holds them) and
   execs the code with the minimal environment from the plan.

Any failure writes its reason on the ready pipe and exits 121 before the code runs: the parent then
refuses to run (fails closed) instead of running the code with less isolation. With isolation
``none`` only steps 4 and 5 run, in place (the code's working directory is a host directory).
"""

import ctypes
import errno
import json
import os
import platform
import resource
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
MNT_DETACH, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 2, -100, 0x8000, 1
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = (
    1,
    4,
    24,
    28,
    38,
)
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
# SECBIT_NOROOT, _NO_SETUID_FIXUP, _KEEP_CAPS_LOCKED, _NO_CAP_AMBIENT_RAISE and their locks.
SECURE_BITS = 0b11101111
SYSCALLS = {
    "x86_64": {
        "pivot_root": 155,
        "mount_setattr": 442,
        "clone": 56,
        "unshare": 272,
        "setns": 308,
        "clone3": 435,
    },
    "aarch64": {
        "pivot_root": 41,
        "mount_setattr": 442,
        "clone": 220,
        "unshare": 97,
        "setns": 268,
        "clone3": 435,
    },
}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
# CLONE_NEWNS, _NEWCGROUP, _NEWUTS, _NEWIPC, _NEWUSER, _NEWPID, _NEWNET, _NEWTIME (unshare only).
NAMESPACE_FLAGS = (
    0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
)
X32_SYSCALL_BIT = 0x40000000
DEVICES = ("null", "zero", "full", "random", "urandom")
EXIT_SETUP_FAILED = 121

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A step of the sandbox setup failed; the code must not run."""


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {errno.errorcode.get(err, err)} ({os.strerror(err)})")


def _mount(source, target, fstype, flags, data=None) -> None:
    args = [None if a is None else a.encode() for a in (source, target, fstype, data)]
    res = libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3])
    _check(res, f"mount {fstype or 'bind'} {source} on {target}")


def _syscall(name: str, *args) -> int:
    table = SYSCALLS.get(platform.machine())
    if table is None:
        raise SetupError(f"unsupported architecture {platform.machine()!r} for {name}")
    return libc.syscall(table[name], *args)


def _bind(root: str, path: str) -> None:
    """Bind ``path`` at the same place under ``root`` (a symlink is copied as a symlink)."""
    target = root + path
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(path):
        if not os.path.lexists(target):
            os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "a").close()
    _mount(path, target, None, MS_BIND | MS_REC)


def _build_root(plan: dict) -> None:
    root = plan["root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates back to the host
    _mount("leafe-root", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=256k,mode=755")
    for path in plan["binds"]:
        if os.path.lexists(path):
            _bind(root, path)
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/dev")
    _mount("leafe-dev", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=16k,mode=755")
    for name in DEVICES:
        _bind(root, "/dev/" + name)
    os.makedirs(root + "/tmp")
    _read_only(root)
    uid = plan["uid"]
    options = (
        f"size={plan['disk_kb']}k,nr_inodes={plan['disk_inodes']},mode=700,uid={uid},gid={uid}"
    )
    _mount("leafe-work", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, options)
    with open(plan["main"], "rb") as f:
        source = f.read()
    with open(root + "/tmp/main.py", "wb") as f:
        f.write(source)
    os.chown(root + "/tmp/main.py", uid, uid)
    os.chdir(root)
    _check(_syscall("pivot_root", b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/tmp")


def _mounts_under(root: str) -> list[tuple[str, str]]:
    """(mount point, per-mount options) of every mount at or below ``root``."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # mountinfo escapes spaces as \040
            if point == root or point.startswith(root + "/"):
                found.append((point, fields[5]))
    return found


_KEEP = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME}
_KEEP |= {"nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}


def _read_only(root: str) -> None:
    """Make every mount under ``root`` read-only, then check that each one is."""
    attr = (ctypes.c_uint64 * 4)(
        MOUNT_ATTR_RDONLY, 0, 0, 0
    )  # struct mount_attr: set, clr, propagation, userns
    if (
        _syscall("mount_setattr", AT_FDCWD, root.encode(), AT_RECURSIVE, ctypes.byref(attr), 32)
        != 0
    ):
        if ctypes.get_errno() != errno.ENOSYS:
            _check(-1, f"mount_setattr read-only on {root}")
        for point, options in _mounts_under(
            root
        ):  # an older kernel or gVisor: one remount per mount
            # A user namespace may not clear the flags a mount was locked with, so keep them all.
            keep = sum(flag for name, flag in _KEEP.items() if name in options.split(","))
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
    for point, _ in _mounts_under(root):
        if not os.statvfs(point).f_flag & os.ST_RDONLY:
            raise SetupError(f"{point} is still writable after the read-only remount")


def _limit(plan: dict) -> None:
    for name, (soft, hard) in plan["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _drop_bounding_set() -> None:
    for cap in range(64):  # EINVAL past the kernel's last capability
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
            _check(-1, f"drop capability {cap} from the bounding set")


def _drop_privileges(plan: dict) -> None:
    """Leave the code no capability and no way to gain one (setuid binaries included)."""
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    _drop_bounding_set()
    _check(
        libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities"
    )
    if plan["setuid"] is not None:  # real root: the fresh uid holds no capability after the switch
        uid = plan["setuid"]
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        # A credential change clears the parent-death signal: set it again, so the code dies with
        # its init.
        _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
    elif plan[
        "userns"
    ]:  # root of the user namespace: the exec below must not hand root's capabilities back
        _check(libc.prctl(PR_SET_SECUREBITS, SECURE_BITS, 0, 0, 0), "PR_SET_SECUREBITS")
    if plan["namespaces"]:
        _deny_namespaces()


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def _namespace_filter() -> list:
    """Seccomp BPF: unshare(2)/clone(2) with a namespace flag and setns(2) fail with EPERM,
    clone3(2) with ENOSYS (its flags sit behind a pointer a filter cannot read; libc then falls back
    to clone), any other ABI (x32, i386) kills the process. Without it the code could make a user
    namespace and hold every capability there (mount, ...), whatever we dropped."""
    arch = platform.machine()
    if arch not in AUDIT_ARCH:
        raise SetupError(f"unsupported architecture {arch!r} for the seccomp filter")
    nr = SYSCALLS[arch]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    eperm, enosys = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    return [  # (code, jump if true, jump if false, k); jumps count instructions skipped
        (ld, 0, 0, 4),  # seccomp_data.arch
        (jeq, 1, 0, AUDIT_ARCH[arch]),
        (ret, 0, 0, kill),
        (ld, 0, 0, 0),  # seccomp_data.nr
        (jge, 7, 0, X32_SYSCALL_BIT),  # -> eperm
        (jeq, 6, 0, nr["setns"]),  # -> eperm
        (jeq, 6, 0, nr["clone3"]),  # -> enosys
        (jeq, 1, 0, nr["unshare"]),  # -> flags
        (jeq, 0, 2, nr["clone"]),  # -> flags, else allow
        (ld, 0, 0, 16),  # flags: the low word of args[0] (both calls take their flags first)
        (jset, 1, 0, NAMESPACE_FLAGS),  # -> eperm
        (ret, 0, 0, allow),
        (ret, 0, 0, eperm),
        (ret, 0, 0, enosys),
    ]


def _deny_namespaces() -> None:
    """Install :func:`_namespace_filter` (needs ``no_new_privs``, set just before); inherited by
    every child."""
    program = _namespace_filter()
    filters = (_SockFilter * len(program))(*(_SockFilter(*insn) for insn in program))
    fprog = _SockFprog(len(program), filters)
    _check(
        libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp filter"
    )


def _clear_own_capabilities() -> None:
    """capset(2) with empty sets: the init keeps its uid but no capability."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable} words, all zero
    _check(libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")


def _start_code(plan: dict, ready: int) -> None:
    """Limits, privileges, ``ok``, exec: from here on the process is the untrusted code."""
    try:
        _limit(plan)
        _drop_privileges(plan)
    except BaseException as e:  # reported to the parent, which refuses to run
        _fail(ready, e)
    os.write(ready, b"ok")
    python = plan["python"]
    os.execve(python, [python, "-I", "-B", "main.py"], plan["env"])


def _init(code_pid: int, status: int) -> None:
    """PID 1 of the run: reap every process, report the code's wait status, and end the namespace
    with it.

    The code runs as PID 2 so that signals and RLIMIT_CPU's SIGXCPU behave as usual (PID 1 ignores
    them).
    """
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    try:
        _clear_own_capabilities()
        _check(
            libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "PR_SET_DUMPABLE"
        )  # the code may not ptrace it
    except SetupError:
        os.kill(code_pid, signal.SIGKILL)  # never leave a privileged process next to the code
        raise
    while True:
        pid, wait_status = os.wait()
        if pid == code_pid:
            os.write(status, str(os.waitstatus_to_exitcode(wait_status)).encode())
            os._exit(0)  # PID 1 exits: the kernel kills whatever the code left behind


def _fail(ready: int, e: BaseException) -> None:
    os.write(ready, f"{type(e).__name__}: {e}".encode()[:2000])
    os._exit(EXIT_SETUP_FAILED)


def main() -> None:
    plan = json.loads(sys.argv[1])
    ready, status = plan["ready_fd"], plan["status_fd"]
    os.set_inheritable(ready, False)
    os.set_inheritable(status, False)
    try:
        if plan["namespaces"]:
            _build_root(plan)
        else:
            os.chdir(plan["work"])
    except BaseException as e:  # every failure is reported to the parent, which refuses to run
        _fail(ready, e)
    if not plan["namespaces"]:
        _start_code(plan, ready)  # no PID namespace: exec in place, the parent sees the exit status
    pid = os.fork()
    if pid == 0:
        _start_code(plan, ready)
    os.close(ready)
    _init(pid, status)


if __name__ == "__main__":
    main()
