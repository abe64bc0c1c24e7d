import java.io.ByteArrayInputStream;
import java.io.ByteArrayOutputStream;
import java.io.DataInputStream;
import java.io.FileInputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.ObjectInputStream;
import java.io.ObjectOutputStream;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.security.MessageDigest;
import java.util.ArrayList;
import java.util.Enumeration;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.zip.CRC32;
import java.util.zip.ZipEntry;
import java.util.zip.ZipFile;
import java.util.zip.ZipInputStream;

import org.nd4j.common.primitives.Pair;

/**
 * Clean-room interop checker for shardkit's SameDiff containers, run on a stock JDK (no DL4J).
 * It uses the JDK's own ObjectInputStream/ObjectOutputStream for the manifest (a
 * LinkedHashMap&lt;String, Pair&lt;Long, Long&gt;&gt;, samediff.md section 2) and java.util.zip for
 * SDZ archives. Every result is printed as one JSON line per input, non-ASCII escaped as
 * UTF-16 \\u units; any failure is an exception and exit status 2.
 *
 * <pre>
 * read FILE...             FILE is a raw manifest or an SDNB file (the header locates the
 *                          manifest); prints {"file", "map_class", "entries":[{name,offset,length}], "header"}
 * write SPEC OUT [...]     SPEC: first line "linked" or "hash" (the map class), then one line
 *                          per entry "offset length hex(UTF-8 name)"; OUT gets
 *                          ObjectOutputStream.writeObject(map), entries put in line order
 * zip FILE...              java.util.zip.ZipFile and ZipInputStream over FILE: every entry read
 *                          fully, CRC-32 checked, SHA-256 printed; SDNB entries' manifests decoded
 * </pre>
 */
public final class ManifestCheck {
    private ManifestCheck() {}

    public static void main(String[] args) throws Exception {
        if (args.length == 0) {
            throw new IllegalArgumentException("usage: read FILE... | write SPEC OUT... | zip FILE...");
        }
        switch (args[0]) {
            case "read":
                for (int i = 1; i < args.length; i++) {
                    System.out.println(readFile(args[i]));
                }
                break;
            case "write":
                if (args.length % 2 != 1) {
                    throw new IllegalArgumentException("write takes SPEC OUT pairs");
                }
                for (int i = 1; i < args.length; i += 2) {
                    write(args[i], args[i + 1]);
                }
                break;
            case "zip":
                for (int i = 1; i < args.length; i++) {
                    System.out.println(zip(args[i]));
                }
                break;
            default:
                throw new IllegalArgumentException("unknown mode " + args[0]);
        }
        System.out.flush();
    }

    // ---------------------------------------------------------------- manifests

    static final byte[] SDNB_MAGIC = {'S', 'D', 'N', 'B'};

    static boolean startsWith(byte[] b, byte[] prefix) {
        if (b.length < prefix.length) {
            return false;
        }
        for (int i = 0; i < prefix.length; i++) {
            if (b[i] != prefix[i]) {
                return false;
            }
        }
        return true;
    }

    static String readFile(String path) throws Exception {
        byte[] bytes = Files.readAllBytes(Paths.get(path));
        StringBuilder sb = new StringBuilder("{\"file\":").append(json(path)).append(',');
        if (startsWith(bytes, SDNB_MAGIC)) {
            sdnb(bytes, sb);
        } else {
            manifest(bytes, 0, bytes.length, sb);
            sb.append(",\"header\":null");
        }
        return sb.append('}').toString();
    }

    /** Header checks of samediff.md 1.2 (big-endian, as RandomAccessFile writes it), then the manifest. */
    static void sdnb(byte[] bytes, StringBuilder sb) throws Exception {
        if (bytes.length < 32) {
            throw new IOException("SDNB shorter than its 32-byte header");
        }
        DataInputStream h = new DataInputStream(new ByteArrayInputStream(bytes, 0, 32));
        h.readInt(); // magic, checked by the caller
        int version = h.readInt();
        long m = h.readLong();
        long len = h.readLong();
        long meta = h.readLong();
        if (version != 1 || meta != 32) {
            throw new IOException("header: version " + version + ", metadataOffset " + meta);
        }
        if (m < 32 || len < 0 || m + len != bytes.length) {
            throw new IOException("header: manifest at " + m + " + " + len + " does not end the file ("
                    + bytes.length + " bytes)");
        }
        manifest(bytes, (int) m, (int) len, sb);
        sb.append(",\"header\":{\"version\":").append(version).append(",\"manifest_offset\":").append(m)
                .append(",\"manifest_length\":").append(len).append(",\"metadata_offset\":").append(meta)
                .append('}');
    }

    /** ObjectInputStream.readObject of the manifest, as SameDiffSerializer does; no trailing bytes. */
    static void manifest(byte[] bytes, int off, int len, StringBuilder sb) throws Exception {
        Object o;
        try (ObjectInputStream in = new ObjectInputStream(new ByteArrayInputStream(bytes, off, len))) {
            o = in.readObject();
            if (in.read() != -1) {
                throw new IOException("trailing bytes after the manifest object");
            }
        }
        if (!(o instanceof Map)) {
            throw new IOException("manifest is a " + o.getClass().getName() + ", not a Map");
        }
        sb.append("\"map_class\":").append(json(o.getClass().getName())).append(",\"entries\":[");
        boolean first = true;
        for (Map.Entry<?, ?> e : ((Map<?, ?>) o).entrySet()) {
            if (!(e.getKey() instanceof String)) {
                throw new IOException("manifest key is a " + e.getKey().getClass().getName());
            }
            if (!(e.getValue() instanceof Pair)) {
                throw new IOException("manifest value is not a Pair: " + e.getValue());
            }
            Pair<?, ?> p = (Pair<?, ?>) e.getValue();
            if (!(p.getKey() instanceof Long) || !(p.getValue() instanceof Long)) {
                throw new IOException("Pair of " + p.getKey() + ", " + p.getValue() + " is not two Longs");
            }
            sb.append(first ? "" : ",").append("{\"name\":").append(json((String) e.getKey()))
                    .append(",\"offset\":").append((long) (Long) p.getKey())
                    .append(",\"length\":").append((long) (Long) p.getValue()).append('}');
            first = false;
        }
        sb.append(']');
    }

    static void write(String spec, String out) throws Exception {
        List<String> lines = Files.readAllLines(Paths.get(spec), StandardCharsets.US_ASCII);
        Map<String, Pair<Long, Long>> map;
        switch (lines.get(0).trim()) {
            case "linked":
                map = new LinkedHashMap<>(); // default constructor, as SameDiffSerializer
                break;
            case "hash":
                map = new HashMap<>();
                break;
            default:
                throw new IllegalArgumentException(spec + ": first line must be linked or hash");
        }
        for (String line : lines.subList(1, lines.size())) {
            if (line.isEmpty()) {
                continue;
            }
            String[] f = line.split(" ", -1);
            String name = new String(unhex(f[2]), StandardCharsets.UTF_8);
            // Pair.of(long, long) in DL4J: autoboxed through Long.valueOf (the Long cache).
            map.put(name, Pair.of(Long.valueOf(Long.parseLong(f[0])), Long.valueOf(Long.parseLong(f[1]))));
        }
        ByteArrayOutputStream bytes = new ByteArrayOutputStream();
        try (ObjectOutputStream oos = new ObjectOutputStream(bytes)) {
            oos.writeObject(map);
        }
        Files.write(Paths.get(out), bytes.toByteArray());
    }

    static byte[] unhex(String s) {
        byte[] b = new byte[s.length() / 2];
        for (int i = 0; i < b.length; i++) {
            b[i] = (byte) Integer.parseInt(s.substring(2 * i, 2 * i + 2), 16);
        }
        return b;
    }

    // ---------------------------------------------------------------- SDZ

    static String zip(String path) throws Exception {
        StringBuilder sb = new StringBuilder("{\"file\":").append(json(path)).append(",\"zipfile\":[");
        try (ZipFile zf = new ZipFile(path)) {
            boolean first = true;
            for (Enumeration<? extends ZipEntry> en = zf.entries(); en.hasMoreElements();) {
                ZipEntry e = en.nextElement();
                byte[] data;
                try (InputStream in = zf.getInputStream(e)) {
                    data = in.readAllBytes();
                }
                // ZipFile does not verify CRC-32 of STORED data itself: compare here.
                long crc = crc(data);
                if (crc != e.getCrc() || data.length != e.getSize()) {
                    throw new IOException(path + "!" + e.getName() + ": CRC " + Long.toHexString(crc) + " / size "
                            + data.length + " against the directory's " + Long.toHexString(e.getCrc()) + " / "
                            + e.getSize());
                }
                sb.append(first ? "" : ",");
                entry(sb, e, data);
                first = false;
            }
        }
        sb.append("],\"zipinputstream\":[");
        try (ZipInputStream zin = new ZipInputStream(new FileInputStream(path))) {
            boolean first = true;
            ZipEntry e;
            while ((e = zin.getNextEntry()) != null) {
                // ZipInputStream checks CRC-32 and sizes at the end of each entry (ZipException).
                byte[] data = zin.readAllBytes();
                sb.append(first ? "" : ",");
                entry(sb, e, data);
                first = false;
            }
        }
        return sb.append("]}").toString();
    }

    static void entry(StringBuilder sb, ZipEntry e, byte[] data) throws Exception {
        sb.append("{\"name\":").append(json(e.getName())).append(",\"method\":").append(e.getMethod())
                .append(",\"size\":").append(e.getSize()).append(",\"compressed_size\":")
                .append(e.getCompressedSize()).append(",\"crc\":").append(e.getCrc()).append(",\"read\":")
                .append(data.length).append(",\"crc_of_data\":").append(crc(data)).append(",\"sha256\":\"")
                .append(sha256(data)).append('"');
        if (startsWith(data, SDNB_MAGIC)) {
            sb.append(",\"sdnb\":{");
            sdnb(data, sb);
            sb.append('}');
        }
        sb.append('}');
    }

    static long crc(byte[] data) {
        CRC32 c = new CRC32();
        c.update(data);
        return c.getValue();
    }

    static String sha256(byte[] data) throws Exception {
        StringBuilder sb = new StringBuilder();
        for (byte b : MessageDigest.getInstance("SHA-256").digest(data)) {
            sb.append(String.format("%02x", b & 0xff));
        }
        return sb.toString();
    }

    /** A JSON string literal: ASCII only, everything else as UTF-16 \\u escapes. */
    static String json(String s) {
        StringBuilder sb = new StringBuilder(s.length() + 2).append('"');
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            if (c == '"' || c == '\\') {
                sb.append('\\').append(c);
            } else if (c < 0x20 || c > 0x7e) {
                sb.append(String.format("\\u%04x", (int) c));
            } else {
                sb.append(c);
            }
        }
        return sb.append('"').toString();
    }
}
