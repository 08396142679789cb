"""Starts LocalStack (as `python -m localstack.runtime.main` would) with one
correction to its SQS FIFO model, so that tests of FIFO order test sqs-once,
not the emulator.

SQS blocks a FIFO message group while any of its messages is in flight: "When
you receive a message with a message group ID, no more messages for the same
message group ID are returned unless you delete the message, or it becomes
visible" (SQS Developer Guide, FIFO queue logic). LocalStack 2026.3 re-opens a
group whenever one of its messages becomes visible again, even while others
of the group are still in flight, so a later message can be handed out before
an earlier one that is in flight elsewhere. Here a message that becomes
visible again re-opens its group only when no other message of the group is
in flight; the group opens again when the last one is deleted or reappears.
The test `emulator::a_fifo_group_stays_blocked_while_any_of_its_messages_is_in_flight`
guards this.
"""

import runpy

from localstack.services.sqs import models


def _put_message(self, message):
    group = self.get_message_group(message.message_group_id)
    with self.mutex:
        previously_empty = group.empty()
        group.push(message)
        if group in self.inflight_groups:
            # A new message never re-opens a group that a receive holds (as in
            # stock LocalStack: between taking a group's messages and marking
            # them in flight, a receive holds the group with none in flight).
            if message.receive_count < 1:
                return
            if any(m.message_group_id == group.message_group_id for m in self.inflight):
                return
            self.inflight_groups.remove(group)
            self.message_group_queue.put_nowait(group)
        elif previously_empty:
            self.message_group_queue.put_nowait(group)


models.FifoQueue._put_message = _put_message

runpy.run_module("localstack.runtime.main", run_name="__main__", alter_sys=True)
