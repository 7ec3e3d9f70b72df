"""Private swarms by access token: a run's authority says who may join, and every protocol checks it.

Theory of operation. A run that admits only its members has an *authority*: an Ed25519 key pair
whose public key every member knows (`TokenAuthority`; its private key can stay on an offline
machine). The authority signs *access tokens*: a token binds one peer's public key, with a username
and an expiration time. A token alone proves nothing: it names a key, and the Noise handshake of
each connection proves that the peer holds that key. So tokens may travel in the clear, and a copied
token is useless to anyone else.

The gate (`AuthGate`, made by `Host(authorizer=...)` or `plexus.DHT(authorizer=...)`): on every new
connection, each side sends its token once on `/plexus/auth/1.0.0`, and the other answers whether
it accepts it: signed by the authority, for the key that Noise authenticated, not expired. Until a
connection's peer has shown an acceptable token, an inbound stream on any other protocol waits for
the answer (at most `timeout`) and is refused if there is none, so every protocol served on the host
(DHT, matchmaking, all-reduce, state sharing, experts, identify, ping, ...) is covered by
construction; so is a stream that arrives after the peer's token expired. A connection whose peer
shows no acceptable token within `timeout` is closed. Each peer renews its token before it expires
and sends the new one on every connection. A refused peer is told why, and its own calls then fail
with an `AuthorizationError` that says so; each refusal is logged once per peer and minute.

The policy is the authorizer's: `AuthorizerBase` (what to present, how to check what a peer
presents), `TokenAuthorizerBase` (access tokens, abstract in how they are obtained and checked; the
same names and roles as hivemind's) and `SignedTokenAuthorizer` (tokens signed by a `TokenAuthority`).
Times are DHT times (`plexus.utils.timing.get_dht_time`), so clocks must roughly agree.
"""

import abc
import asyncio
import inspect
import os
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..errors import PeerError, UsageError
from ..utils.logging import get_logger
from ..utils.timing import get_dht_time
from .identity import IdentityError, PeerID, PrivateKey, PublicKey, load_or_create_identity
from .messages import Message, MessageError
from .protocols.errors import ProtocolError
from .protocols.multistream import MultistreamDialer
from .stream import StreamError, read_delimited, write_delimited

logger = get_logger(__name__)

AUTH_PROTOCOL = "/plexus/auth/1.0.0"
MAX_CREDENTIALS_SIZE = 4096
TOKEN_DOMAIN = b"plexus-access-token:"


class AuthorizationError(PeerError, ConnectionError):
    """A peer refused our access token, or presented one we refuse; the message says why."""


@dataclass(frozen=True)
class AccessToken(Message):
    """The authority's word that the holder of `public_key` (a libp2p public key) may join until
    `expiration_time` (DHT time)."""

    username: str
    public_key: bytes
    expiration_time: float
    signature: bytes = b""

    def signed_bytes(self) -> bytes:
        return TOKEN_DOMAIN + AccessToken(self.username, self.public_key, self.expiration_time).encode()


@dataclass(frozen=True)
class AuthAnswer(Message):
    """The answer to a presented token: accepted until `expiration_time`, or refused for `reason`."""

    accepted: bool
    reason: str = ""
    expiration_time: float = 0.0


# --- the policy ------------------------------------------------------------------------------------


class AuthorizerBase(abc.ABC):
    """What a peer presents to others, and how it checks what they present (see the module comment)."""

    local_private_key: PrivateKey | None = None

    def bind(self, private_key: PrivateKey) -> None:
        """Called by the host: the key whose peers' tokens must name (our identity)."""
        if self.local_private_key is None:
            self.local_private_key = private_key
        elif self.local_private_key.peer_id != private_key.peer_id:
            raise UsageError(
                "the authorizer's local_private_key is not the host's identity: a token for "
                "it would not match the key our connections authenticate. Pass the same key "
                "or none"
            )

    @property
    def local_public_key(self) -> PublicKey:
        if self.local_private_key is None:
            raise UsageError("the authorizer has no key yet: pass local_private_key, or give it to a Host")
        return self.local_private_key.public_key

    @abc.abstractmethod
    async def credentials(self) -> bytes:
        """What to present on a new connection (and again whenever it changes)."""

    @abc.abstractmethod
    async def validate(self, peer: PeerID, public_key: PublicKey, credentials: bytes) -> float:
        """Check what `peer` (authenticated as `public_key`) presented; return until when it is valid.

        Raises:
            AuthorizationError: the credentials are not acceptable (the message tells the peer why).
        """

    def refresh_period(self) -> float:
        """Seconds until `credentials()` should be asked again, to renew them before they expire."""
        return 30.0


class TokenAuthorizerBase(AuthorizerBase):
    """Access tokens: subclasses say how a token is obtained (`get_token`) and when it is good
    (`is_token_valid`, `does_token_need_refreshing`); the token is checked to name the peer's key."""

    def __init__(self, local_private_key: PrivateKey | None = None):
        self.local_private_key = local_private_key
        self._local_access_token: AccessToken | None = None
        self._refresh_lock: asyncio.Lock | None = None

    @abc.abstractmethod
    async def get_token(self) -> AccessToken:
        """A fresh token for `local_public_key` (ask the authority, read a file, ...)."""

    @abc.abstractmethod
    def is_token_valid(self, access_token: AccessToken) -> bool:
        """Whether a token is genuine and not expired (it is checked to name the right key elsewhere)."""

    @abc.abstractmethod
    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        """Whether our token should be replaced now (it expires soon)."""

    @property
    def local_access_token(self) -> AccessToken | None:
        return self._local_access_token

    async def refresh_token_if_needed(self) -> None:
        self._refresh_lock = self._refresh_lock or asyncio.Lock()
        async with self._refresh_lock:
            token = self._local_access_token
            if token is None or self.does_token_need_refreshing(token):
                token = await self.get_token()
                if token.public_key != self.local_public_key.to_protobuf():
                    raise UsageError(
                        "get_token() returned a token for another key than ours (local_public_key)"
                    )
                self._local_access_token = token

    async def credentials(self) -> bytes:
        await self.refresh_token_if_needed()
        token = self._local_access_token
        assert token is not None  # refresh_token_if_needed always leaves one
        return token.encode()

    async def validate(self, peer: PeerID, public_key: PublicKey, credentials: bytes) -> float:
        try:
            token = AccessToken.decode(credentials)
        except MessageError as error:
            raise AuthorizationError(
                f"malformed access token: {error}", peer=peer, protocol=AUTH_PROTOCOL
            ) from None
        if token.public_key != public_key.to_protobuf():
            raise AuthorizationError(
                "the access token names another key than this connection's", peer=peer, protocol=AUTH_PROTOCOL
            )
        if not self.is_token_valid(token):
            now = get_dht_time()
            reason = (
                f"the access token expired at {token.expiration_time:.0f} (now {now:.0f})"
                if token.expiration_time <= now
                else "the access token is not signed by this run's authority"
            )
            raise AuthorizationError(reason, peer=peer, protocol=AUTH_PROTOCOL)
        return token.expiration_time

    def refresh_period(self) -> float:
        token = self._local_access_token
        if token is None:
            return 1.0
        return max(0.05, min(30.0, (token.expiration_time - get_dht_time()) / 4))


class TokenAuthority:
    """A run's authority: an Ed25519 key that signs access tokens. Keep its private key to yourself
    (offline if you like: tokens can be issued ahead of time and handed out as files)."""

    def __init__(self, private_key: PrivateKey | None = None):
        self.private_key = private_key or PrivateKey.generate()

    @classmethod
    def load_or_create(cls, path: str | os.PathLike) -> "TokenAuthority":
        return cls(load_or_create_identity(path))

    @property
    def public_key(self) -> PublicKey:
        return self.private_key.public_key

    def issue(
        self,
        peer_public_key: PublicKey,
        username: str = "",
        lifetime: float = 3600.0,
        now: float | None = None,
    ) -> AccessToken:
        """A token letting the holder of `peer_public_key` in for `lifetime` seconds from `now`."""
        now = get_dht_time() if now is None else now
        token = AccessToken(username, peer_public_key.to_protobuf(), now + lifetime)
        return AccessToken(
            token.username,
            token.public_key,
            token.expiration_time,
            self.private_key.sign(token.signed_bytes()),
        )


class SignedTokenAuthorizer(TokenAuthorizerBase):
    """Tokens signed by one authority's key: peers holding one are let in, everyone else is not.

    Args:
        authority_public_key: the run's authority (`TokenAuthority.public_key`).
        get_token: returns (or returns an awaitable of) a fresh token for the public key it is given:
            `authority.issue` when the authority is at hand, or e.g. a function reading a token file
            that an operator renews, or asking the run's web service.
        refresh_before: ask for a new token when ours expires within this many seconds.
    """

    def __init__(
        self,
        authority_public_key: PublicKey,
        get_token: Callable[[PublicKey], AccessToken | Awaitable[AccessToken]],
        *,
        local_private_key: PrivateKey | None = None,
        refresh_before: float = 60.0,
    ):
        super().__init__(local_private_key)
        self.authority_public_key, self._get_token = authority_public_key, get_token
        self.refresh_before = refresh_before

    async def get_token(self) -> AccessToken:
        token = self._get_token(self.local_public_key)
        return await token if inspect.isawaitable(token) else token

    def is_token_valid(self, access_token: AccessToken) -> bool:
        return access_token.expiration_time > get_dht_time() and self.authority_public_key.verify(
            access_token.signature, access_token.signed_bytes()
        )

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return access_token.expiration_time - get_dht_time() < self.refresh_before


# --- the gate on a host ----------------------------------------------------------------------------


class _ConnectionAuth:
    """Both directions of one connection: whether its peer showed a good token, and whether it took ours."""

    def __init__(self):
        self.theirs_until = 0.0
        self.theirs_refusal: str | None = None
        self.theirs_checked = asyncio.Event()
        self.ours_until = 0.0
        self.ours_refusal: str | None = None
        self.ours_answered = asyncio.Event()


class AuthGate:
    """Checks peers' tokens on a host's connections and presents ours (see the module comment)."""

    def __init__(self, host, authorizer: AuthorizerBase, timeout: float = 10.0):
        authorizer.bind(host.private_key)
        self.host, self.authorizer, self.timeout = host, authorizer, timeout
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._presented: bytes | None = None
        host.set_stream_handler(AUTH_PROTOCOL, self._serve, max_per_peer=2)

    def _state(self, connection) -> _ConnectionAuth:
        state = self._states.get(connection)
        if state is None:
            state = self._states[connection] = _ConnectionAuth()
        return state

    def start(self) -> None:
        self.host._spawn(self._renew())

    def connection_opened(self, connection) -> None:
        self._state(connection)
        self.host._spawn(self._present(connection))
        self.host._spawn(self._expect(connection))

    # --- ours ----------------------------------------------------------------------------------------

    async def _credentials(self) -> bytes | None:
        try:
            self._presented = await self.authorizer.credentials()
        except Exception as error:  # the authorizer is user code: whatever it raises, we cannot present
            self.host.refused(("no access token",), f"we have no access token to present: {error!r}")
            return None
        return self._presented

    async def _present(self, connection) -> None:
        state = self._state(connection)
        credentials = self._presented if self._presented is not None else await self._credentials()
        if credentials is None:
            state.ours_refusal = "we have no access token"
            state.ours_answered.set()
            return
        stream = None
        try:
            async with asyncio.timeout(self.timeout):
                stream = connection.open_stream()
                dialer = MultistreamDialer([AUTH_PROTOCOL])
                await stream.write(dialer.data_to_send())
                stream._negotiation = dialer
                await write_delimited(stream, credentials)
                await stream.close()
                data = await read_delimited(stream, MAX_CREDENTIALS_SIZE)
            answer = AuthAnswer.decode(data or b"")
            if answer.accepted:
                state.ours_refusal, state.ours_until = None, max(state.ours_until, answer.expiration_time)
            else:
                state.ours_refusal = answer.reason or "refused"
        except (
            TimeoutError,
            ProtocolError,
            StreamError,
            ConnectionError,
            MessageError,
            asyncio.IncompleteReadError,
        ) as error:
            state.ours_refusal = (
                f"it did not answer our access token ({error!r}): it is no member of this swarm"
            )
            if stream is not None:
                stream.reset()
        state.ours_answered.set()
        if state.ours_refusal is not None:
            self.host.refused(
                ("our token refused", connection.remote_peer),
                f"{connection.remote_peer} did not take our access token: {state.ours_refusal}",
            )

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.authorizer.refresh_period())  # a periodic check, not synchronisation
            before = self._presented
            if await self._credentials() not in (None, before):
                for peer in self.host.connected_peers():
                    for connection in self.host.connections_to(peer):
                        self.host._spawn(self._present(connection))

    async def check_outbound(self, connection) -> None:
        """Before we open a stream: both sides must have taken each other's token, else AuthorizationError
        (we neither talk to outsiders nor let them answer us)."""
        state, peer = self._state(connection), connection.remote_peer
        try:
            async with asyncio.timeout(self.timeout):
                await state.ours_answered.wait()
                await state.theirs_checked.wait()
        except TimeoutError:
            pass
        if state.theirs_until <= get_dht_time():  # first: refused, it may have left before answering us
            reason = state.theirs_refusal or (
                "its access token expired"
                if state.theirs_until
                else f"it presented no access token within {self.timeout} s"
            )
            raise AuthorizationError(
                f"{peer} is not a member of this swarm: {reason}", peer=peer, protocol=AUTH_PROTOCOL
            )
        if state.ours_refusal is not None:
            raise AuthorizationError(
                f"{peer} refused our access token: {state.ours_refusal}", peer=peer, protocol=AUTH_PROTOCOL
            )
        if state.ours_until <= get_dht_time():
            raise AuthorizationError(
                f"our access token expired at {state.ours_until:.0f} and the authorizer "
                f"gave us no new one yet",
                peer=peer,
                protocol=AUTH_PROTOCOL,
            )

    # --- theirs --------------------------------------------------------------------------------------

    async def _serve(self, stream) -> None:
        peer, connection = stream.remote_peer, stream.connection
        state = self._state(connection)
        async with asyncio.timeout(self.timeout):
            data = await read_delimited(stream, MAX_CREDENTIALS_SIZE)
        try:
            public_key = connection.remote_public_key
            if data is None or public_key is None:
                raise AuthorizationError("no access token was presented", peer=peer, protocol=AUTH_PROTOCOL)
            until = await self.authorizer.validate(peer, public_key, data)
            state.theirs_until, state.theirs_refusal = max(state.theirs_until, until), None
            answer = AuthAnswer(True, expiration_time=until)
        except (AuthorizationError, IdentityError) as error:
            state.theirs_refusal = str(error)
            answer = AuthAnswer(False, reason=str(error))
            self.host.refused(("refused token", peer), f"refused the access token of {peer}: {error}")
        try:
            await write_delimited(stream, answer.encode())
            await stream.close()
        finally:
            state.theirs_checked.set()  # after the answer is out: a refused peer may be closed at once

    async def _expect(self, connection) -> None:
        """Close a connection whose peer shows no acceptable token within `timeout`."""
        state = self._state(connection)
        try:
            async with asyncio.timeout(self.timeout):
                await state.theirs_checked.wait()
        except TimeoutError:
            state.theirs_refusal = f"it presented no access token within {self.timeout} s"
        if state.theirs_until <= get_dht_time() and not connection.is_closed:
            self.host.refused(
                ("unauthorized connection", connection.remote_peer),
                f"closing the connection from {connection.remote_peer}: {state.theirs_refusal}",
            )
            await connection.close()

    async def admit(self, stream) -> str | None:
        """Whether an inbound stream may be served: None, or why not."""
        state = self._state(stream.connection)
        if not state.theirs_checked.is_set():
            try:
                async with asyncio.timeout(self.timeout):
                    await state.theirs_checked.wait()
            except TimeoutError:
                return f"it presented no access token within {self.timeout} s"
        now = get_dht_time()
        if state.theirs_until > now:
            return None
        if state.theirs_refusal is not None:
            return state.theirs_refusal
        return f"its access token expired at {state.theirs_until:.0f} (now {now:.0f})"
