"""An emulated network filesystem for the benchmarks: an LD_PRELOAD shim that adds a fixed
latency to every metadata call (a stat, an open, an unlink, a rename, a directory read, a
mkdir, a utime) on paths under one directory, as each is a round trip to the server on NFS
or Lustre. Data reads and writes are not delayed (an NFS server streams them).

The shim is C, compiled here with the system's C compiler into a cache directory on first
use (`build_shim`); `shim_env(directory, latency_ms)` is the environment that loads it into
child processes. Calls through a directory file descriptor (`openat(dir_fd, ...)`, the way
kvtier's file tiers walk their trees) are delayed when that descriptor's path is under the
directory (read from /proc/self/fd, itself not delayed). Linux and glibc only.

Primitives: `build_shim`, `shim_env` (both raise `kvtier.errors.ShimUnavailable`),
`default_cache`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvtier.errors import ShimUnavailable

SOURCE = r"""
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const char *prefix;
static size_t prefix_len;
static long delay_ns = -1;

static void setup(void) {
    if (delay_ns >= 0) return;
    const char *p = getenv("KVTIER_FSLAT_DIR");
    const char *us = getenv("KVTIER_FSLAT_US");
    prefix = p ? p : "";
    prefix_len = strlen(prefix);
    delay_ns = (p && us) ? atol(us) * 1000L : 0;
}

static int under(const char *path) {
    return prefix_len && path && strncmp(path, prefix, prefix_len) == 0
        && (path[prefix_len] == 0 || path[prefix_len] == '/');
}

static int fd_under(int fd) {
    char link[64], target[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n <= 0) return 0;
    target[n] = 0;
    return under(target);
}

static void maybe_wait(int dirfd, const char *path) {
    setup();
    if (delay_ns <= 0) return;
    int hit = (path && path[0] == '/') ? under(path)
            : (dirfd == AT_FDCWD || dirfd < 0) ? 0 : fd_under(dirfd);
    if (!hit && path && path[0] != '/' && dirfd == AT_FDCWD) {
        char cwd[PATH_MAX];
        hit = getcwd(cwd, sizeof cwd) && under(cwd);
    }
    if (hit) {
        struct timespec t = {delay_ns / 1000000000L, delay_ns % 1000000000L};
        nanosleep(&t, NULL);
    }
}

#define REAL(name, ret, ...) \
    static ret (*real_##name)(__VA_ARGS__); \
    if (!real_##name) real_##name = dlsym(RTLD_NEXT, #name)

int openat(int dirfd, const char *path, int flags, ...) {
    REAL(openat, int, int, const char *, int, ...);
    va_list ap; va_start(ap, flags); mode_t mode = va_arg(ap, int); va_end(ap);
    maybe_wait(dirfd, path);
    return real_openat(dirfd, path, flags, mode);
}
int openat64(int dirfd, const char *path, int flags, ...) {
    REAL(openat64, int, int, const char *, int, ...);
    va_list ap; va_start(ap, flags); mode_t mode = va_arg(ap, int); va_end(ap);
    maybe_wait(dirfd, path);
    return real_openat64(dirfd, path, flags, mode);
}
int open(const char *path, int flags, ...) {
    REAL(open, int, const char *, int, ...);
    va_list ap; va_start(ap, flags); mode_t mode = va_arg(ap, int); va_end(ap);
    maybe_wait(AT_FDCWD, path);
    return real_open(path, flags, mode);
}
int open64(const char *path, int flags, ...) {
    REAL(open64, int, const char *, int, ...);
    va_list ap; va_start(ap, flags); mode_t mode = va_arg(ap, int); va_end(ap);
    maybe_wait(AT_FDCWD, path);
    return real_open64(path, flags, mode);
}
int fstatat(int dirfd, const char *path, struct stat *st, int flags) {
    REAL(fstatat, int, int, const char *, struct stat *, int);
    maybe_wait(dirfd, path);
    return real_fstatat(dirfd, path, st, flags);
}
int fstatat64(int dirfd, const char *path, struct stat64 *st, int flags) {
    REAL(fstatat64, int, int, const char *, struct stat64 *, int);
    maybe_wait(dirfd, path);
    return real_fstatat64(dirfd, path, st, flags);
}
int stat(const char *path, struct stat *st) {
    REAL(stat, int, const char *, struct stat *);
    maybe_wait(AT_FDCWD, path);
    return real_stat(path, st);
}
int stat64(const char *path, struct stat64 *st) {
    REAL(stat64, int, const char *, struct stat64 *);
    maybe_wait(AT_FDCWD, path);
    return real_stat64(path, st);
}
int lstat(const char *path, struct stat *st) {
    REAL(lstat, int, const char *, struct stat *);
    maybe_wait(AT_FDCWD, path);
    return real_lstat(path, st);
}
int lstat64(const char *path, struct stat64 *st) {
    REAL(lstat64, int, const char *, struct stat64 *);
    maybe_wait(AT_FDCWD, path);
    return real_lstat64(path, st);
}
int unlinkat(int dirfd, const char *path, int flags) {
    REAL(unlinkat, int, int, const char *, int);
    maybe_wait(dirfd, path);
    return real_unlinkat(dirfd, path, flags);
}
int unlink(const char *path) {
    REAL(unlink, int, const char *);
    maybe_wait(AT_FDCWD, path);
    return real_unlink(path);
}
int renameat(int olddirfd, const char *oldpath, int newdirfd, const char *newpath) {
    REAL(renameat, int, int, const char *, int, const char *);
    maybe_wait(olddirfd, oldpath);
    return real_renameat(olddirfd, oldpath, newdirfd, newpath);
}
int rename(const char *oldpath, const char *newpath) {
    REAL(rename, int, const char *, const char *);
    maybe_wait(AT_FDCWD, oldpath);
    return real_rename(oldpath, newpath);
}
int mkdirat(int dirfd, const char *path, mode_t mode) {
    REAL(mkdirat, int, int, const char *, mode_t);
    maybe_wait(dirfd, path);
    return real_mkdirat(dirfd, path, mode);
}
int mkdir(const char *path, mode_t mode) {
    REAL(mkdir, int, const char *, mode_t);
    maybe_wait(AT_FDCWD, path);
    return real_mkdir(path, mode);
}
int utimensat(int dirfd, const char *path, const struct timespec times[2], int flags) {
    REAL(utimensat, int, int, const char *, const struct timespec *, int);
    maybe_wait(dirfd, path);
    return real_utimensat(dirfd, path, times, flags);
}
int futimens(int fd, const struct timespec times[2]) {
    REAL(futimens, int, int, const struct timespec *);
    maybe_wait(fd, NULL);
    return real_futimens(fd, times);
}
DIR *fdopendir(int fd) {
    REAL(fdopendir, DIR *, int);
    maybe_wait(fd, NULL);
    return real_fdopendir(fd);
}
DIR *opendir(const char *path) {
    REAL(opendir, DIR *, const char *);
    maybe_wait(AT_FDCWD, path);
    return real_opendir(path);
}
"""


def build_shim(cache: Path | None = None) -> Path:
    """The shim's shared object, compiled on first use into `cache` (default:
    `default_cache()`), kept there by its source's hash.

    Raises:
        ShimUnavailable: no C compiler, or the build failed.
    """
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not Path("/proc/self/fd").is_dir():
        raise ShimUnavailable("emulating a filesystem's latency needs Linux and a C compiler")
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    cache = cache or default_cache()
    target = cache / f"fslatency-{digest}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as work:
        source = Path(work) / "fslatency.c"
        source.write_text(SOURCE)
        built = Path(work) / target.name
        result = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(built),
                                 str(source), "-ldl"], capture_output=True, text=True)
        if result.returncode:
            raise ShimUnavailable(f"the shim did not build: {result.stderr.strip()[:500]}")
        os.replace(built, target)
    return target


def default_cache() -> Path:
    """Where the shim is kept between runs: $XDG_CACHE_HOME/kvtier/fslatency, or
    ~/.cache/kvtier/fslatency, beside the tools' generated models. Not the temp dir, where
    a kvtier-fslatency/ stayed after every run (tests included), of no process's."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier" / "fslatency"


def shim_env(directory: Path, latency_ms: float, env: dict[str, str] | None = None,
             cache: Path | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the shim preloaded: every metadata call on a
    path under `directory` waits `latency_ms` first. `cache`: as `build_shim`'s.

    Raises:
        ShimUnavailable: see `build_shim`.
    """
    out = dict(os.environ if env is None else env)
    preload = str(build_shim(cache))
    out["LD_PRELOAD"] = " ".join(p for p in (preload, out.get("LD_PRELOAD", "")) if p)
    out["KVTIER_FSLAT_DIR"] = str(Path(directory).resolve())
    out["KVTIER_FSLAT_US"] = str(round(latency_ms * 1000))
    return out
