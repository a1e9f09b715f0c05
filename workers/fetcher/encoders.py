"""A fetcher's links to the vision encoders: a channel per encoder address (`common.discovery`), opened as the
address joins, drained and then closed as it leaves, so encoders come and go without a restart of anything."""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from common.discovery import EncoderDirectory, EncoderEndpoint
from common.dispatch import Dispatcher
from common.protocol import Message, Ping
from common.transport import Channel, EventLoop, Transport

log = logging.getLogger(__name__)


class EncoderLinks:
    def __init__(
        self,
        directory: EncoderDirectory,
        transport: Transport,
        loop: EventLoop,
        dispatcher: Dispatcher,
        on_message: Callable[[bytes, Message], None],
    ) -> None:
        """``on_message(key, msg)``: what an encoder sent, ``key`` its `EncoderEndpoint.key` (the dispatcher's)."""
        self.directory, self.transport, self.loop, self.dispatcher = directory, transport, loop, dispatcher
        self.on_message = on_message
        self.channels: dict[bytes, Channel] = {}
        self.endpoints: dict[bytes, EncoderEndpoint] = {}
        self.leaving: set[bytes] = set()

    @property
    def known(self) -> int:
        """Encoders in the directory now (those draining out not counted)."""
        return len(self.channels) - len(self.leaving)

    def by_value(self, key: bytes) -> bool:
        endpoint = self.endpoints.get(key)
        return endpoint is not None and endpoint.by_value

    def refresh(self) -> None:
        """The directory again: a channel for each encoder that joined, the ones that left drained (closed once
        they hold no job, `close_drained`)."""
        joined, left = self.directory.refresh()
        for endpoint in joined:
            if endpoint.key in self.leaving:  # (back before it had drained)
                self.leaving.discard(endpoint.key)
                self.dispatcher.undrain(endpoint.key)
            elif endpoint.key not in self.channels:
                self.open(endpoint)
            log.info("encoder %s at %s joined", endpoint.label, endpoint.address)
        for endpoint in left:
            log.info("encoder %s at %s left: draining it", endpoint.label, endpoint.address)
            self.leaving.add(endpoint.key)
            self.dispatcher.drain(endpoint.key)
        self.close_drained()

    def open(self, endpoint: EncoderEndpoint) -> None:
        channel = self.transport.channel(zmq.DEALER, endpoint.hub, bind=False, address=endpoint.address)
        self.channels[endpoint.key], self.endpoints[endpoint.key] = channel, endpoint
        self.loop.on_message(channel, lambda _peer, msg, key=endpoint.key: self.on_message(key, msg))
        channel.send(Ping("fetcher"))  # (its status says it is live at once, not at the next heartbeat)

    def close_drained(self) -> None:
        for key in [k for k in self.leaving if self.dispatcher.drained(k)]:
            self.dispatcher.forget_peer(key)
            channel = self.channels.pop(key)
            self.loop.forget(channel)
            channel.close()
            self.leaving.discard(key)
            log.info("encoder %s drained and closed", self.endpoints.pop(key).label)

    def send(self, key: bytes, msg: Message) -> bool:
        channel = self.channels.get(key)
        if channel is None:
            return False
        channel.send(msg)
        return True

    def ping(self) -> None:
        for channel in self.channels.values():
            channel.send(Ping("fetcher"))

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
