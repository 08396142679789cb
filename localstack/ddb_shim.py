"""Stand-in for the DynamoDB Local Java process that LocalStack launches.

LocalStack's DynamoDB provider starts `$JAVA_HOME/bin/java ... -jar DynamoDBLocal.jar
-port P ...` and proxies DynamoDB requests to 127.0.0.1:P.  `localstack/up` puts a
tiny `java` script in that place which runs this file instead: moto's DynamoDB
backend (Apache-2.0, shipped with localstack-core) on the same port.

moto's stock server is threaded and not atomic across concurrent requests (two
conditional writes on one item can both pass).  Real DynamoDB serialises writes per
item, so this server handles one request at a time: concurrency tests then test the
consumer's code, not the emulator's races.

moto backs up every table a TransactWriteItems touches with a deep copy of the
whole table (to roll back on cancellation), so each transaction costs time
proportional to the table's size and a long run slows down quadratically. This
server backs up only the items the transaction names instead (same rollback,
same cancellation reasons).
"""

import copy
import sys

from moto.server import create_backend_app
from werkzeug.serving import run_simple


def item_level_transaction_rollback() -> None:
    import moto.dynamodb.models as models
    from moto.dynamodb.models.dynamo_type import DynamoType
    from moto.dynamodb.models.table import Table

    class TablesNotCopied:
        """`copy` for moto's module, except that tables are not deep-copied."""

        def __getattr__(self, name):
            return getattr(copy, name)

        @staticmethod
        def deepcopy(x, memo=None):
            return x if isinstance(x, Table) else copy.deepcopy(x, memo)

    models.copy = TablesNotCopied()
    original = models.DynamoDBBackend.transact_write_items

    def transact_write_items(self, transact_items):
        saved = []
        for entry in transact_items:
            _, op = next(iter(entry.items()))
            table = self.tables.get(op.get("TableName"))
            attrs = op.get("Key") or op.get("Item") or {}
            if table is None or table.hash_key_attr not in attrs:
                continue
            h = DynamoType(attrs[table.hash_key_attr])
            if table.range_key_attr is None:
                saved.append((table, h, None, copy.deepcopy(table.items.get(h))))
            elif table.range_key_attr in attrs:
                r = DynamoType(attrs[table.range_key_attr])
                group = table.items.get(h) or {}
                saved.append((table, h, r, copy.deepcopy(group.get(r))))
        try:
            return original(self, transact_items)
        except Exception:
            for table, h, r, item in reversed(saved):
                if r is None:
                    if item is None:
                        table.items.pop(h, None)
                    else:
                        table.items[h] = item
                else:
                    group = table.items[h]
                    if item is None:
                        group.pop(r, None)
                    else:
                        group[r] = item
            raise

    models.DynamoDBBackend.transact_write_items = transact_write_items


def main(argv: list[str]) -> None:
    port = None
    for i, arg in enumerate(argv):
        if arg == "-port" and i + 1 < len(argv):
            port = int(argv[i + 1])
    if port is None:
        sys.exit("ddb_shim: no -port argument given")

    # HTTP/1.0 on purpose: one request per connection, so a pooled idle
    # connection can never hold the single request slot.
    item_level_transaction_rollback()
    app = create_backend_app("dynamodb")
    run_simple("127.0.0.1", port, app, threaded=False, processes=1, use_reloader=False)


if __name__ == "__main__":
    main(sys.argv[1:])
