"""The on-disk format's version numbers, shared by the backends, the store and persistence."""

# 2: rows carry a last-update stamp column and a checksum word; 3: the write-behind log lives in
# its own LMDB environment (`wlog/`), and the tables record the sequence number merged through
FORMAT_VERSION = 3
# 4: format 3 with the tables as page-chunk levels (`StoreConfig(table_format="chunks")`)
CHUNK_FORMAT = 4
# on-disk versions whose tables hold rows this tierstore reads as they are (format 2 differs only
# in where the write-behind log lives; a writable open converts it in place, docs/persistence.md)
ROW_FORMATS = (2, 3, 4)
