"""Who may talk to an mpcache server, and who may clear it (docs/security.md).

* **TCP: ZMQ CURVE.** ``keygen(DIR)`` (``mpcache-server keygen DIR``) writes a server key pair and
  one client key pair per name::

      DIR/server.key            server public key   (give it to every client)
      DIR/server.key_secret     server secret key   (stays with the server, mode 0600)
      DIR/authorized/NAME.key   public keys of the clients the server accepts
      DIR/NAME.key_secret       client NAME's key pair (give it to that client, mode 0600)

  The server refuses to start (``cannot start:``) on a secret file that is a symlink, not its
  uid's or open to group/others, on ``DIR`` or ``DIR/authorized`` not a real directory of its
  uid, ``DIR`` writable by group/others or ``authorized`` open to them at all (0700), and on an
  authorized key that is a symlink, another uid's or writable by group/others: each would let
  another local user choose the keys the server trusts.
  A server started with ``--curve-dir DIR`` runs a ZAP authenticator (pyzmq's
  ``ThreadAuthenticator``, owned and joined by the server) that accepts only the public keys in
  ``DIR/authorized``; any other peer fails the handshake and the server never sees a frame from
  it. A client uses ``client_curve(sock, DIR, NAME)``.
* **IPC: the socket's directory.** ``prepare_ipc_path`` creates the directory 0700 (0750 with a
  group) or verifies an existing one: it must be a real directory (no symlink), owned by the
  server's uid, not writable by group or others; a socket already at the path (a killed
  server's, or one a supervisor is replacing) is taken over, any other file is never touched. Connecting to a unix socket needs
  search permission on its directory and write permission on the socket, so only the server's
  uid (and root), or the configured group, can connect.
* **Identity.** ``routing_id_handover``: a reconnecting client gets its ROUTER identity back
  (``ROUTER_HANDOVER``) only where that identity is no bearer secret (docs/security.md).
* **Admin.** ``clear`` drops every tenant's cache: it needs the admin token, a secret read from a
  file given with ``--admin-token-file`` (owned by the server's uid, mode 0600 or tighter). No
  file: ``clear`` is refused for everyone.
"""

from __future__ import annotations

import errno
import grp
import hmac
import ipaddress
import logging
import os
import socket
import stat
from typing import Any, Final

import zmq

from mpcache.runtime_zmq.private_file import PrivateFileError, read_private_file

log = logging.getLogger("mpcache.auth")

SERVER_NAME: Final = "server"
AUTHORIZED: Final = "authorized"


class AuthError(Exception):
    """A key, directory, socket path or token file the server refuses to use."""


def _private(path: str) -> None:
    os.chmod(path, 0o600)


def keygen(directory: str, client: str = "client") -> dict[str, str]:
    """Create ``directory`` (0700) with a server key pair (kept if present) and a key pair for
    ``client`` whose public key is authorized. Returns the paths written or kept."""
    if not client or "/" in client or client.startswith(".") or client == SERVER_NAME:
        raise AuthError(f"bad client name {client!r}")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    authorized = os.path.join(directory, AUTHORIZED)
    os.makedirs(authorized, mode=0o700, exist_ok=True)
    server_public = os.path.join(directory, f"{SERVER_NAME}.key")
    server_secret = os.path.join(directory, f"{SERVER_NAME}.key_secret")
    import zmq.auth  # CURVE only: a server without --curve-dir never imports it

    if not os.path.exists(server_secret):
        zmq.auth.create_certificates(directory, SERVER_NAME)
    _private(server_secret)
    client_secret = os.path.join(directory, f"{client}.key_secret")
    if os.path.exists(client_secret):
        raise AuthError(f"{client_secret} exists: pick another client name")
    public, secret = zmq.auth.create_certificates(directory, client)
    _private(secret)
    os.chmod(public, 0o644)  # a public key: readable, writable by this uid alone (whatever the umask)
    if os.path.exists(server_public):
        os.chmod(server_public, 0o644)
    os.chmod(authorized, 0o700)
    os.replace(public, os.path.join(authorized, f"{client}.key"))
    return {"server_public": server_public, "server_secret": server_secret,
            "client_secret": client_secret, "authorized": authorized}


def _check_owned(path: str, st: os.stat_result, what: str) -> None:
    if st.st_uid != os.geteuid():
        raise AuthError(f"{what} {path} belongs to uid {st.st_uid}, not this process's {os.geteuid()}")


def _load_secret(path: str) -> tuple[bytes, bytes]:
    """A CURVE key pair from a secret file: a regular file (a symlink is refused, never followed),
    owned by this uid, with no group or other access."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise AuthError(f"CURVE secret {path} is a symlink: give the file itself") from None
        raise AuthError(f"cannot read {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AuthError(f"CURVE secret {path} is not a regular file")
        _check_owned(path, st, "CURVE secret")
        if st.st_mode & 0o077:
            raise AuthError(f"CURVE secret {path} is accessible to group or others (mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
        import zmq.auth

        public, secret = zmq.auth.load_certificate(path)
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise AuthError(f"CURVE secret {path} was replaced while it was read")
    finally:
        os.close(fd)
    if secret is None:
        raise AuthError(f"{path} holds no secret key")
    return public, secret


def check_authorized(directory: str) -> str:
    """``directory/authorized`` as the server may trust it: the key directory and ``authorized``
    are real directories of this uid that no group or other user can write (``authorized``: no
    group/other access at all, 0700), and every ``*.key`` in it is a regular file of this uid that
    only it can write. Anything else would let another user add a client key. Returns its path."""
    for d, private in ((directory, False), (os.path.join(directory, AUTHORIZED), True)):
        try:
            st = os.lstat(d)
        except OSError as e:
            raise AuthError(f"cannot use {d}: {e.strerror}") from None
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise AuthError(f"{d} is not a directory (a symlink or a file): give the directory itself")
        _check_owned(d, st, "CURVE key directory")
        mode = stat.S_IMODE(st.st_mode)
        if mode & (0o077 if private else 0o022):
            raise AuthError(f"{d} is {'accessible' if private else 'writable'} by group or others (mode {mode:04o}); "
                            f"chmod {'700' if private else 'go-w'} it")
    authorized = os.path.join(directory, AUTHORIZED)
    for name in sorted(os.listdir(authorized)):
        if not name.endswith(".key"):
            continue
        path = os.path.join(authorized, name)
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise AuthError(f"authorized key {path} is not a regular file (a symlink?): copy the key itself")
        _check_owned(path, st, "authorized key")
        if st.st_mode & 0o022:
            raise AuthError(f"authorized key {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); chmod 644 it")
    return authorized


class CurveServer:
    """The ROUTER's CURVE keys and the ZAP authenticator thread that admits only authorized
    client keys. ``stop()`` joins the thread."""

    def __init__(self, ctx: zmq.Context[Any], directory: str) -> None:
        self.ctx = ctx  # other sockets the server serves with these keys (KV events) live here too
        authorized = check_authorized(directory)
        self.public, self.secret = _load_secret(os.path.join(directory, f"{SERVER_NAME}.key_secret"))
        if not any(n.endswith(".key") for n in os.listdir(authorized)):
            raise AuthError(f"{authorized} has no client keys: run `mpcache-server keygen {directory}`")
        # zmq.auth.thread imports asyncio (about 50 ms): only a CURVE server pays for it
        from zmq.auth.thread import ThreadAuthenticator

        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("mpcache.auth.zap"))
        self._auth.start()
        self._auth.configure_curve(domain="*", location=authorized)
        log.info("CURVE on: %d authorized client key(s) in %s", sum(n.endswith(".key") for n in os.listdir(authorized)), authorized)

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def stop(self) -> None:
        self._auth.stop()


def client_curve(sock: zmq.Socket[Any], directory: str, client: str = "client") -> None:
    """Set a client socket's CURVE keys (before ``connect``): the server's public key from
    ``directory/server.key``, the client's pair from ``directory/<client>.key_secret``."""
    import zmq.auth

    server_public, _ = zmq.auth.load_certificate(os.path.join(directory, f"{SERVER_NAME}.key"))
    public, secret = _load_secret(os.path.join(directory, f"{client}.key_secret"))
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


# ---------------------------------------------------------------------------------------------
# IPC


def _group_id(group: str | None) -> int | None:
    if group is None:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isdigit():
            return int(group)
        raise AuthError(f"unknown group {group!r}") from None


def _socket_is_live(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(0.5)
        s.connect(path)
        return True
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        return True  # cannot tell: do not take it over
    finally:
        s.close()


def prepare_ipc_path(path: str, group: str | None = None) -> int | None:
    """Make ``path``'s directory safe for the server's socket (see the module docstring) and
    clear a stale socket at ``path``. Returns the group id to give the socket (or None).
    Raises ``AuthError`` for a directory or file the server must not use."""
    gid = _group_id(group)
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.lexists(d):
        os.makedirs(d, mode=0o700)
    st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise AuthError(f"ipc directory {d} is not a directory (a symlink or a file)")
    if st.st_uid != os.geteuid():
        raise AuthError(f"ipc directory {d} belongs to uid {st.st_uid}, not this server's {os.geteuid()}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise AuthError(f"ipc directory {d} is writable by group or others (mode {mode:o}): use a private one")
    want = 0o700 if gid is None else 0o750
    if mode != want:
        os.chmod(d, want)
    if gid is not None and st.st_gid != gid:
        os.chown(d, -1, gid)
    if os.path.lexists(path):
        pst = os.lstat(path)
        if not stat.S_ISSOCK(pst.st_mode):
            raise AuthError(f"{path} exists and is not a socket: refusing to replace it")
        # A socket: a killed server's, or a running one's that a supervisor is replacing (the new
        # server takes the path over; the old one keeps its open connections until it exits).
        if _socket_is_live(path):
            log.warning("taking over %s from a server still listening on it", path)
        else:
            log.info("removed the stale socket %s", path)
        os.unlink(path)
    return gid


def restrict_ipc_socket(path: str, gid: int | None) -> None:
    """After bind: the socket is 0600 (0660 and the group's with a group)."""
    if gid is not None:
        os.chown(path, -1, gid)
    os.chmod(path, 0o600 if gid is None else 0o660)


# ---------------------------------------------------------------------------------------------
# Identity


def routing_id_handover(bound_url: str, *, curve: bool) -> bool:
    """Whether a routing id may move to a new connection (``ROUTER_HANDOVER``): only where it is
    no bearer secret -- CURVE (the peer is its key), ipc, or TCP bound to a loopback address."""
    if curve or bound_url.startswith("ipc://"):
        return True
    host = bound_url.partition("://")[2].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------
# Admin


def read_admin_token(path: str) -> bytes:
    """The admin token in ``path`` (surrounding whitespace stripped). The file must belong to
    the server's uid and be readable by it alone; an empty token is refused."""
    try:
        token = read_private_file(path)
    except PrivateFileError as e:
        raise AuthError(f"admin token file {path}: {e}") from None
    if len(token) < 16:
        raise AuthError(f"admin token in {path} is shorter than 16 bytes")
    return token


def admin_ok(configured: bytes | None, given: object) -> bool:
    """Whether ``given`` (a request's admin token payload) is the configured token."""
    if configured is None or not isinstance(given, str):
        return False
    return hmac.compare_digest(configured, given.encode("utf-8", "surrogatepass"))


def keygen_main(argv: list[str]) -> int:
    """``mpcache-server keygen DIR [--client NAME]``."""
    import argparse

    p = argparse.ArgumentParser(prog="mpcache-server keygen", description="make CURVE keys for --curve-dir DIR")
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--client", default="client", help="name of the client key pair to add (default client)")
    args = p.parse_args(argv)
    try:
        paths = keygen(args.directory, args.client)
    except (AuthError, OSError) as e:
        print(f"mpcache-server keygen: {e}")
        return 1
    print(f"server public key (give to clients): {paths['server_public']}")
    print(f"client key pair for {args.client!r} (give to that client only): {paths['client_secret']}")
    print(f"start the server with: mpcache-server --curve-dir {args.directory}")
    return 0
