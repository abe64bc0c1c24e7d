package org.nd4j.common.primitives;

import java.io.Serializable;

/**
 * Clean-room stand-in for ND4J's {@code org.nd4j.common.primitives.Pair}, written from
 * samediff.md section 2.2 only: the class name, serialVersionUID 119, and two object fields
 * {@code key} and {@code value} (erased to {@code Object}), no custom writeObject. That is all
 * the serialization stream records, so ObjectInputStream/ObjectOutputStream treat it exactly
 * as the real class.
 */
public class Pair<K, V> implements Serializable {
    private static final long serialVersionUID = 119L;

    protected K key;
    protected V value;

    public Pair(K key, V value) {
        this.key = key;
        this.value = value;
    }

    public static <K, V> Pair<K, V> of(K key, V value) {
        return new Pair<>(key, value);
    }

    public K getKey() {
        return key;
    }

    public V getValue() {
        return value;
    }
}
