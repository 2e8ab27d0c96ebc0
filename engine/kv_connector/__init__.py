"""The KV connector: reservations, hand-offs, import and export of KV pages (engine.kv_connector.connector)."""
